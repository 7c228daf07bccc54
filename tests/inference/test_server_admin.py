"""Admin side of the inference server: API key, weight updates (good and bad checkpoints), pause and
resume, and an injected engine fault. The server runs in-process (uvicorn in a thread) over the
real native engine, so the test can also look at the engine directly."""

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_process import serve_in_thread
from transformers import AutoModelForCausalLM

from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.server import build_app
from tandem.models.tiny import build_tiny_model

API_KEY = "test-key"
SERVED_NAME = "tiny-served"
PROMPT = [5, 9, 14, 20, 3]


@dataclass
class InProcessServer:
    url: str
    engine: AsyncEngine
    run_dir: Path

    def post(
        self, path: str, body: dict | None = None, key: str | None = API_KEY, **kwargs
    ) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(
            self.url + path, json=body, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs
        )

    def greedy(self, max_tokens: int = 10) -> dict:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
        response = self.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    run_dir = tmp_path_factory.mktemp("run")
    config = InferenceConfig.model_validate(
        {
            "model": {"name": str(tiny_model)},
            "api_key": API_KEY,
            "served_model_name": SERVED_NAME,
            "run_dir": str(run_dir),
            "pause_timeout_s": 1.5,
            "trust_request_chat_template": True,
            "engine": {"max_model_len": 512},
        }
    )
    engine = AsyncEngine(config)
    with serve_in_thread(build_app(engine, engine.tokenizer, config)) as url:
        yield InProcessServer(url, engine, run_dir)


def transformers_greedy(path: Path, max_tokens: int = 10) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_template_that_renders_nothing_is_a_400_naming_messages(
    server: InProcessServer, stream: bool
) -> None:
    """Refused before a stream begins, not by the engine as an error event after a 200. (A template
    of the request's own: this server trusts them.)"""
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"chat_template": "{{ '' }}"},
        "stream": stream,
    }
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"


def test_api_key(server: InProcessServer) -> None:
    for key in (None, "wrong"):
        response = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
        assert server.post("/update_weights", {"step": 0}, key=key).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    out = client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=2)
    assert out.model == SERVED_NAME


def test_weight_updates_switch_outputs_and_versions(
    server: InProcessServer, tiny_model: Path, tmp_path: Path
) -> None:
    before = server.greedy()
    assert before["token_ids"] == transformers_greedy(tiny_model)
    other = build_tiny_model(out=tmp_path / "other", seed=1)
    expected_other = transformers_greedy(other)
    assert expected_other != before["token_ids"]

    response = server.post("/update_weights", {"path": str(other)})
    assert response.status_code == 200, response.text
    version = response.json()["weight_version"]
    assert version == 1
    after = server.greedy()
    assert after["token_ids"] == expected_other and after["weight_versions"] == [version]
    assert httpx.get(server.url + "/health").json()["weight_version"] == version
    assert "tandem_weight_version 1" in httpx.get(server.url + "/metrics").text

    # `step: N` loads run_dir/weights/step_N and reports version N
    shutil.copytree(tiny_model, server.run_dir / "weights" / "step_5")
    response = server.post("/update_weights", {"step": 5})
    assert response.status_code == 200 and response.json()["weight_version"] == 5
    assert server.greedy()["token_ids"] == before["token_ids"]
    assert server.greedy()["weight_versions"] == [5]


def test_bad_checkpoints_keep_the_old_weights(
    server: InProcessServer, tiny_model: Path, tmp_path: Path
) -> None:
    live = server.greedy()
    version = server.engine.weight_version
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 10)
    wrong_shape = build_tiny_model(out=tmp_path / "wide", hidden_size=128, head_dim=32, intermediate_size=256)
    bodies = [
        {"path": str(tmp_path / "missing")},
        {"path": str(corrupt)},
        {"path": str(wrong_shape)},
        {"step": 999},
    ]
    for body in bodies:
        response = server.post("/update_weights", body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == next(iter(body)), response.text  # (step's: step)
        assert "old weights stay live" in response.json()["error"]["message"]
        assert server.greedy() == live
        assert server.engine.weight_version == version
    for body in ({}, {"path": "x", "step": 1}, {"step": -1}, {"paht": "x"}):
        response = server.post("/update_weights", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "step", response.text


def test_unreadable_weight_paths_are_400s_naming_the_path(server: InProcessServer) -> None:
    live = server.greedy()
    for body in ({"path": "~no-such-user-here/weights"}, {"path": "/" + "a" * 5000}):
        response = server.post("/update_weights", body)
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["param"] == "path", response.text[:300]
    response = server.post("/update_weights")
    assert response.status_code == 400 and "no body" in response.json()["error"]["message"], response.text
    assert server.greedy() == live


BAD_BODIES = [
    (b'{"path": "/tmp/\\ud800"}', {}, "malformed JSON"),  # a lone surrogate (httpx's json= would not send it)
    (b'{"path": "\xff"}', {}, "malformed JSON"),  # not UTF-8
    (b'{"path": ' + b"[" * 10000 + b"]" * 10000 + b"}", {}, "malformed JSON"),  # nested too deep
    (b'["path"]', {}, "the request body must be a JSON object"),
    (
        b'{"path": "/no/such/dir"}',
        {"content-type": "text/plain"},
        "/no/such/dir",
    ),  # read as JSON all the same
]


@pytest.mark.parametrize(("content", "headers", "message"), BAD_BODIES)
def test_admin_bodies_are_read_as_generation_bodies_are(
    server: InProcessServer, content: bytes, headers: dict, message: str
) -> None:
    """(FastAPI's own parsing answered a body not UTF-8 or nested too deep with "There was an error
    parsing the body", and a list, or JSON sent as text/plain, with "Input should be a valid
    dictionary or object to extract fields from". A lone surrogate is refused as in generation
    bodies.)"""
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json", **headers}
    response = httpx.post(server.url + "/update_weights", content=content, headers=headers, timeout=30)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_an_idle_kept_alive_connection_outlives_the_clients_expiry(server: InProcessServer) -> None:
    """A connection idle for longer than httpx's 5 s keep-alive expiry is still open, so a client
    never sends on a connection the server is closing at the same moment."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    request = f"GET /health HTTP/1.1\r\nHost: {url.hostname}\r\n\r\n".encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        for _ in range(2):
            conn.sendall(request)
            reply = conn.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            time.sleep(6)


def test_pause_holds_new_requests_until_resume(server: InProcessServer) -> None:
    assert server.post("/pause").json()["paused"] is True
    assert httpx.get(server.url + "/health").json()["paused"] is True
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server.greedy, 4)
        deadline = time.monotonic() + 5
        while "tandem_requests_waiting_for_resume 1" not in httpx.get(server.url + "/metrics").text:
            assert time.monotonic() < deadline, "the request did not wait for resume"
            time.sleep(0.05)
        assert not pending.done()
        assert server.post("/resume").json()["paused"] is False
        assert len(pending.result(timeout=30)["token_ids"]) == 4


def test_pause_times_out_with_503(server: InProcessServer) -> None:
    server.post("/pause")
    try:
        started = time.monotonic()
        response = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and "paused" in response.json()["error"]["message"]
        assert 1.4 < time.monotonic() - started < 10
    finally:
        server.post("/resume")
    assert server.greedy(2)["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_a_pause_is_let_go_at_once(server: InProcessServer, stream: bool) -> None:
    """(It stayed counted as waiting for resume until the pause ended or timed out, then got a 503.)"""

    def counter(name: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])

    aborted = counter("tandem_http_requests_aborted_total")
    server.post("/pause")
    try:
        body = {"prompt": "x", "max_tokens": 2, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            server.post("/v1/completions", body, timeout=httpx.Timeout(10, read=0.3))
        deadline = time.monotonic() + 1.0  # (well before the pause's 1.5 s timeout)
        while (
            counter("tandem_requests_waiting_for_resume")
            or counter("tandem_http_requests_aborted_total") == aborted
        ):
            assert time.monotonic() < deadline, "the request still waits for resume, its client gone"
            time.sleep(0.05)
    finally:
        server.post("/resume")
    assert server.greedy(2)["token_ids"]


def test_pause_freezes_running_requests(server: InProcessServer) -> None:
    body = {"prompt": "x", "max_tokens": 80, "ignore_eos": True, "stream": True, "return_token_ids": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        server.post("/pause")
        time.sleep(0.2)
        frozen = server.engine.stats().generated_tokens_total
        time.sleep(0.3)
        assert server.engine.stats().generated_tokens_total == frozen
        assert server.engine.stats().running == 1
        server.post("/resume")
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert server.engine.stats().kv_blocks_used == 0


def test_internal_error_is_a_500_and_the_server_keeps_serving(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_generate(*args, **kwargs):
        raise RuntimeError("injected engine fault")
        yield  # an async generator, like the real one

    def failed_total() -> float:
        text = httpx.get(server.url + "/metrics").text
        return float(
            next(
                line for line in text.splitlines() if line.startswith("tandem_http_requests_failed_total")
            ).split()[1]
        )

    failed_before = failed_total()
    with monkeypatch.context() as patch:
        patch.setattr(server.engine, "generate", broken_generate)
        response = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert response.status_code == 500
        assert "injected engine fault" in response.json()["error"]["message"]
        stream = server.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}
        )
        events = [line for line in stream.text.splitlines() if line]
        assert "injected engine fault" in events[-2] and events[-1] == "data: [DONE]"
    assert server.greedy(3)["token_ids"]
    assert failed_total() == failed_before + 2
