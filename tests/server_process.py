"""Start a real inference server (`python -m tandem.inference.cli`) on a free 127.0.0.1 port.

Shared by the inference, orchestrator and trainer tests (`pythonpath = ["tests"]` in pyproject).
"""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from tandem.net import free_port


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def start_server(
    args: list[str],
    log_path: Path,
    timeout_s: float = 120.0,
    threads: str | None = None,
    entry: tuple[str, ...] = ("-m", "tandem.inference.cli"),
    env: dict[str, str] | None = None,
) -> Iterator[RunningServer]:
    """Run `inference ARGS --port P` in a subprocess until /health answers; stop it afterwards.

    `threads` sets the server's OMP_NUM_THREADS (default: the caller's, else 2); `entry` is what
    python runs (`("-c", code)` for a server with an injected fault); `env` adds variables."""
    port = free_port()
    threads = threads or os.environ.get("OMP_NUM_THREADS", "2")
    env = {**os.environ, "OMP_NUM_THREADS": threads, **(env or {})}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, *entry, *args, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()[-3000:]}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the server did not answer /health within {timeout_s:g} s:\n{server.log()[-3000:]}"
                )
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


@contextmanager
def serve_in_thread(app: object, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a thread of this process on a free port (keeping idle
    connections as long as the real servers do); yields its URL."""
    from tandem.inference.cli import KEEP_ALIVE_S

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
