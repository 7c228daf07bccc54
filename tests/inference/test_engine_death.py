"""A server whose engine thread died says so and goes away, instead of answering /health forever.

The fault is injected into the real engine (its step raises); everything else is real: the
in-process test looks at the HTTP answers, the subprocess test at the process's exit."""

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import serve_in_thread, start_server

from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.server import build_app

COMPLETION = {"prompt": [5, 9, 14], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def served_engine(tiny_model: Path) -> Iterator[tuple[str, AsyncEngine]]:
    config = InferenceConfig.model_validate(
        {"model": {"name": str(tiny_model)}, "engine": {"max_model_len": 128}}
    )
    engine = AsyncEngine(config)
    with serve_in_thread(build_app(engine, engine.tokenizer, config)) as url:
        yield url, engine


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death itself
def test_dead_engine_answers_503(
    served_engine: tuple[str, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, engine = served_engine
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    died = threading.Event()
    engine.on_death = died.set

    def broken_step() -> None:
        raise RuntimeError("injected step fault")

    monkeypatch.setattr(engine.core, "step", broken_step)
    first = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
    assert first.status_code == 503, first.text
    assert "injected step fault" in first.json()["error"]["message"]
    assert died.wait(10), "on_death was not called"
    assert engine.dead_reason is not None and "injected step fault" in engine.dead_reason

    health = httpx.get(url + "/health")
    assert health.status_code == 503
    assert "engine died" in health.json()["error"]["message"]
    later = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)  # after the death
    assert later.status_code == 503, later.text


FAULTY_SERVER = """
import sys
from tandem.inference.cli import main
from tandem.inference.engine.core import EngineCore

def broken_step(self):
    raise RuntimeError("injected step fault")

EngineCore.step = broken_step
main(sys.argv[1:])
"""


def test_server_process_exits_when_its_engine_dies(tiny_model: Path, tmp_path: Path) -> None:
    args = ["--model.name", str(tiny_model), "--engine.max-model-len", "128"]
    with start_server(args, tmp_path / "server.log", entry=("-c", FAULTY_SERVER)) as server:
        response = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=30)
        assert response.status_code == 503, response.text
        try:
            code = server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server kept running after its engine died:\n{server.log()[-2000:]}")
    assert code == 2
    log = server.log()
    assert "the inference engine died" in log and "injected step fault" in log
