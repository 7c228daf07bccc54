"""Start a real inference server (`python -m tandem.inference.cli`) on a free 127.0.0.1 port.

Shared by the inference, orchestrator and trainer tests (`pythonpath = ["tests"]` in pyproject).
"""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from tandem.net import free_port, free_ports

SERVER_ENTRY = ("-m", "tandem.inference.cli")  # what python runs for an inference server


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
    entry: tuple[str, ...] = SERVER_ENTRY,
    env: dict[str, str] | None = None,
) -> Iterator[RunningServer]:
    """Run `inference ARGS --port P` in a subprocess until /health answers; stop it afterwards.

    `threads` sets the server's OMP_NUM_THREADS (default: the caller's, else 2); `entry` is what
    python runs (`("-c", code)` for a server with an injected fault); `env` adds variables."""
    server = _spawn(args, log_path, threads, entry, env)
    try:
        _wait_healthy(server, timeout_s)
        yield server
    finally:
        _stop(server.process)


@contextmanager
def start_servers(
    servers: list[tuple[list[str], Path]], first_port: int | None = None, timeout_s: float = 120.0
) -> Iterator[list[RunningServer]]:
    """`start_server(ARGS, LOG_PATH)` for each (ARGS, LOG_PATH) of `servers`, with their start-ups
    overlapping: every process is started before any is waited for, then each must answer
    /health within `timeout_s`. For servers that talk to each other only once requests come (a
    prefill server and its decode server); server i listens on `first_port` + i (default: the
    first of len(servers) consecutive free ports), so that one's URL can be in another's ARGS.
    Stopped afterwards, the last first."""
    first_port = free_ports(len(servers)) if first_port is None else first_port
    with ExitStack() as stack:
        running = []
        for i, (args, log_path) in enumerate(servers):
            server = _spawn(args, log_path, None, SERVER_ENTRY, None, first_port + i)
            stack.callback(_stop, server.process)
            running.append(server)
        for server in running:
            _wait_healthy(server, timeout_s)
        yield running


def _spawn(
    args: list[str],
    log_path: Path,
    threads: str | None,
    entry: tuple[str, ...],
    env: dict[str, str] | None,
    port: int | None = None,
) -> RunningServer:
    port = port or free_port()
    threads = threads or os.environ.get("OMP_NUM_THREADS", "2")
    env = {**os.environ, "OMP_NUM_THREADS": threads, **(env or {})}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, *entry, *args, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return RunningServer(f"http://127.0.0.1:{port}", process, log_path)


def _wait_healthy(server: RunningServer, timeout_s: float) -> None:
    process = server.process
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the server did not answer /health within {timeout_s:g} s:\n{server.log()[-3000:]}"
            )
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
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
