"""`backend = "vllm"`: start vLLM as a child process, wait for it, serve tandem's front before it.

The front listens on `config.host:port`; vLLM listens on 127.0.0.1 at a private port with a private
API key. vLLM is stopped when the front exits (SIGTERM, Ctrl-C, error), and the front exits with
vLLM's last log lines when vLLM dies.
"""

import logging
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import httpx
import uvicorn

from tandem.cli import UserError
from tandem.inference.cli import http_server
from tandem.inference.config import InferenceConfig
from tandem.inference.vllm.process import VLLMDiedError, VLLMProcess, new_api_key, vllm_command, vllm_env
from tandem.inference.vllm.proxy import build_front
from tandem.net import free_port

CONNECT_METHOD = "tandem_connect_weights"
"""The worker extension's method that joins the weight link (tandem.inference.vllm.worker_extension)."""

log = logging.getLogger("tandem.inference.vllm")


def resolve_python(config: InferenceConfig) -> str:
    python = config.vllm.python or sys.executable
    found = shutil.which(python) if not Path(python).is_file() else python
    if found is None:
        raise UserError(f"vllm.python: no Python interpreter at {python}")
    return found


def check_port_free(host: str, port: int) -> None:
    """Fail before the slow vLLM start-up, not after it."""
    if port == 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"port: cannot listen on {host}:{port} ({e.strerror})") from None


def connect_weights(config: InferenceConfig, upstream: str, key: str) -> None:
    """Have vLLM's worker join the trainer's weight link (it waits for the trainer in the background)."""
    w = config.weights
    link = {
        "transport": w.transport,
        "host": w.host,
        "port": w.port,
        "server_index": w.server_index,
        "transfer_timeout_s": w.transfer_timeout_s,
        "connect_timeout_s": w.connect_timeout_s,
        "bucket_bytes": w.bucket_bytes,
    }
    if not w.port:
        raise UserError(f"weights.port: transport {w.transport} needs the weight group's port (rl picks one)")
    body = {"method": CONNECT_METHOD, "args": [link], "timeout": config.vllm.admin_timeout_s}
    response = httpx.post(
        f"{upstream}/collective_rpc",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=config.vllm.admin_timeout_s + 30,
    )
    if response.status_code != 200:
        raise UserError(
            f"vLLM could not join the weight link ({response.status_code}): {response.text[:300]}"
        )
    if problems := [r["error"] for r in response.json()["results"] if not r.get("ok")]:
        raise UserError(f"weights.transport = {w.transport}: {problems[0]}")
    log.info("weights by %s: vLLM joins the trainer at %s:%d", w.transport, w.host, w.port)


def _exit_on_sigterm(signum: int, _: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def watch(process: VLLMProcess, server: uvicorn.Server, died: threading.Event) -> None:
    """Stop the front as soon as vLLM exits."""
    while not server.should_exit:
        if process.returncode() is not None:
            died.set()
            server.should_exit = True
            return
        time.sleep(0.5)


def serve_vllm(config: InferenceConfig) -> None:
    """Blocking: run vLLM and the front until SIGTERM/Ctrl-C or until vLLM dies (exit code 1)."""
    if not config.model.name:
        raise UserError("model.name: give the model to serve (a directory or a hub name)")
    python = resolve_python(config)
    check_port_free(config.host, config.port)
    port = config.vllm.port or free_port()
    key = new_api_key()
    process = VLLMProcess(vllm_command(config, python, port, key), vllm_env(config))
    upstream = f"http://127.0.0.1:{port}"
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        log.info("starting vLLM (%s) on %s", python, upstream)
        try:
            process.start()
        except OSError as e:
            raise UserError(f"vllm.python: cannot run {python}: {e}") from None
        try:
            seconds = process.wait_healthy(f"{upstream}/health", config.vllm.startup_timeout_s)
        except (VLLMDiedError, TimeoutError) as e:
            log.error("%s", e)
            raise SystemExit(1) from None
        log.info("vLLM is up after %.0f s; serving on http://%s:%d", seconds, config.host, config.port)
        app = build_front(config, upstream, key)
        if config.weights.in_memory:
            connect_weights(config, upstream, key)
        server = http_server(app, config)
        died = threading.Event()
        threading.Thread(target=watch, args=(process, server, died), name="vllm-watch", daemon=True).start()
        server.run()
        if died.is_set():
            log.error("%s", process.died_error())
            raise SystemExit(1)
    finally:
        process.stop()
        signal.signal(signal.SIGTERM, previous)
