"""Fixtures of the environment tests: one tiny model and one real inference server serving it
(127.0.0.1, free port), shared by every test file here that plays rollouts against a server."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import start_server

from tandem.models.tiny import build_tiny_model

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    return build_tiny_model(out=out, num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128)


@pytest.fixture(scope="session")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of the server; environment tests only sample from it (no weight updates)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model.name", str(model), "--engine.max-model-len", str(MAX_MODEL_LEN)]
    with start_server(args, log, 180.0, threads="1") as running:
        yield running.url
