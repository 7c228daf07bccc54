"""Fixtures that start a real inference server (`python -m tandem.inference.cli`) on 127.0.0.1."""

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from server_process import RunningServer, start_server

from tandem.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def launch_server() -> Callable[..., AbstractContextManager[RunningServer]]:
    """`with launch_server(args, log_path) as server:` starts `inference ARGS` on a free port."""
    return start_server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Qwen3 (fp32 on CPU), built once per test module."""
    return build_tiny_model(out=tmp_path_factory.mktemp("model") / "tiny")
