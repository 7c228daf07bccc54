"""Fixtures: a tiny model and a real inference server serving it on 127.0.0.1 (free port)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import start_server

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
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model.name", str(tiny_model), "--engine.max-model-len", "256"]
    with start_server(args, log_path, STARTUP_TIMEOUT_S, threads="1") as running:
        yield running.url
