"""Fixtures: a tiny model and a real inference server serving it on 127.0.0.1 (free port)."""

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.models.tiny import build_tiny_model

STARTUP_TIMEOUT_S = 180.0


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    return build_tiny_model(out=out, num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128)


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a native-engine inference server, started serving `tiny_model` as version 0 and
    shared by the session: tests that need version 0 call `serve_base_model` first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model.name", str(tiny_model), "--port", str(port), "--engine.max-model-len", "256"]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem.inference.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"inference server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no /health answer within {STARTUP_TIMEOUT_S:g}s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
