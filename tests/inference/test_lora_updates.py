"""LoRA weight updates of the native server (in-process, CPU, fp32): an adapter from the trainer's
LoRA model, as a PEFT directory (filesystem) or streamed (broadcast, colocated), is merged into
the server's weights so that its logprobs equal those of the merged model that transformers
computes; every adapter is merged onto the base, not onto the previous merge; an adapter that
does not fit is refused with the old weights live."""

import json
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from server_process import serve_in_thread
from transformers import AutoModelForCausalLM
from weight_link_helpers import server_weights

from tandem.config.base import ModelConfig
from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.server import build_app
from tandem.models.loading import load_tokenizer
from tandem.models.lora import lora_layers
from tandem.models.tiny import build_tiny_model
from tandem.net import free_port
from tandem.trainer.config import LoRAConfig, ParallelConfig
from tandem.trainer.hf_export import write_hf_model
from tandem.trainer.model import build_trainer_model
from tandem.trainer.parallel import init_distributed
from tandem.trainer.weight_publisher import update_stream
from tandem.transport.weight_link import LinkSettings
from tandem.transport.weight_sender import WeightSender

PROMPT = [5, 9, 14, 20, 3, 7]
TINY = {"num_layers": 2, "hidden_size": 64, "head_dim": 16, "intermediate_size": 128}


class Trainer:
    """tandem's trainer model with LoRA on the default targets; `adapter(seed)` stands in for a
    training step (new random adapters) and writes the adapter and the merged model."""

    def __init__(self, base: Path, root: Path, rank: int = 4) -> None:
        self.base, self.root = base, root
        self.world = init_distributed("cpu")
        lora = LoRAConfig(rank=rank, alpha=2.0 * rank)
        self.model = build_trainer_model(
            ModelConfig(name=str(base), device="cpu"), self.world, ParallelConfig(), lora=lora
        )
        self.tokenizer = load_tokenizer(str(base))

    @torch.no_grad()
    def adapter(self, seed: int) -> tuple[Path, Path]:
        generator = torch.Generator().manual_seed(seed)
        for layer in lora_layers(self.model).values():
            for param in (layer.lora_a, layer.lora_b):
                param.to_local().copy_(torch.randn(param.shape, generator=generator) * 0.2)
        adapter, merged = self.root / f"adapter_{seed}", self.root / f"merged_{seed}"
        write_hf_model(self.model, self.tokenizer, adapter, self.world)
        write_hf_model(self.model, self.tokenizer, merged, self.world, merged=True)
        return adapter, merged


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    root = tmp_path_factory.mktemp("lora_updates")
    return Trainer(build_tiny_model(out=root / "base", **TINY), root)


@contextmanager
def server(
    base: Path, transport: str, trainer: Trainer, base_on_cpu: bool = False
) -> Iterator[tuple[str, WeightSender]]:
    settings = LinkSettings("127.0.0.1", free_port(), 30.0, 60.0, 512 << 20)
    engine_config = {"max_model_len": 128, "lora_base_on_cpu": base_on_cpu}
    weights = server_weights(transport, settings)
    config = InferenceConfig.model_validate(
        {"model": {"name": str(base)}, "engine": engine_config, "weights": weights}
    )
    engine = AsyncEngine(config)  # its receiver joins the link in the background
    sender = WeightSender(settings, 1, 0, 1, torch.device("cpu"))
    with serve_in_thread(build_app(engine, engine.tokenizer, config)) as url:
        sender.connect(lambda dtype: update_stream(trainer.model, dtype)[0])
        try:
            yield url, sender
        finally:
            sender.close()


def served(url: str) -> tuple[list[int], torch.Tensor]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])


def assert_serves(url: str, merged: Path) -> None:
    """The server's greedy tokens and their logprobs are the merged model's (transformers)."""
    ids, logprobs = served(url)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    full = torch.tensor([PROMPT + ids])
    with torch.no_grad():
        reference = model(input_ids=full).logits[0, len(PROMPT) - 1 : -1].log_softmax(-1)
    assert ids == reference.argmax(-1).tolist()
    torch.testing.assert_close(
        logprobs, reference.gather(-1, torch.tensor(ids)[:, None])[:, 0], rtol=0, atol=1e-4
    )


def stream(
    url: str, sender: WeightSender, trainer: Trainer, version: int, headers: dict | None = None
) -> httpx.Response:
    """Stream the trainer's adapter as `version` while the server is told to receive it."""
    specs, tensors, meta = update_stream(trainer.model, sender.dtype)
    failures: list[BaseException] = []

    def send() -> None:
        try:
            sender.send(version, specs, tensors, meta=meta)
        except BaseException as e:  # reported below
            failures.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    answer = httpx.post(url + "/update_weights", json={"step": version}, headers=headers, timeout=300)
    thread.join(timeout=60)
    assert not failures, failures
    return answer


def test_adapters_from_disk_and_broadcast_merge_onto_the_base(trainer: Trainer, tmp_path: Path) -> None:
    first, first_merged = trainer.adapter(seed=1)
    with server(trainer.base, "broadcast", trainer) as (url, sender):
        base_ids, _ = served(url)
        answer = httpx.post(url + "/update_weights", json={"path": str(first)}, timeout=60)
        assert answer.status_code == 200 and answer.json()["weight_version"] == 1, answer.text
        assert_serves(url, first_merged)
        assert served(url)[0] != base_ids  # the adapter changed what the server generates

        _, second_merged = trainer.adapter(seed=2)
        answer = stream(url, sender, trainer, version=2)
        assert answer.status_code == 200 and answer.json()["weight_version"] == 2, answer.text
        assert_serves(url, second_merged)  # onto the base: onto the first merge this would differ

        wrong = tmp_path / "wrong_rank"
        shutil.copytree(first, wrong)
        config = json.loads((wrong / "adapter_config.json").read_text())
        (wrong / "adapter_config.json").write_text(json.dumps(config | {"r": 8}))
        answer = httpx.post(url + "/update_weights", json={"path": str(wrong)}, timeout=60)
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "does not fit the model" in message and "at rank 8 needs" in message, message
        assert "the old weights stay live" in message
        assert_serves(url, second_merged)

        norm = tmp_path / "norm_target"  # a LoRA pair aimed at a norm's 1-D weight: a 400, not a 500
        shutil.copytree(first, norm)
        tensors = load_file(norm / "adapter_model.safetensors")
        rank = json.loads((norm / "adapter_config.json").read_text())["r"]
        hidden = next(t for k, t in tensors.items() if "lora_A" in k).shape[1]
        prefix = "base_model.model.model.norm"
        tensors |= {
            f"{prefix}.lora_A.weight": torch.zeros(rank, hidden),
            f"{prefix}.lora_B.weight": torch.zeros(hidden, rank),
        }
        save_file(tensors, norm / "adapter_model.safetensors")
        answer = httpx.post(url + "/update_weights", json={"path": str(norm)}, timeout=60)
        assert answer.status_code == 400, answer.text
        assert "model.norm.weight is not a linear layer's weight" in answer.json()["error"]["message"]

        no_bias_key = tmp_path / "no_bias_key"  # peft's default when the key is absent: bias "none"
        shutil.copytree(first, no_bias_key)
        config.pop("bias", None)
        (no_bias_key / "adapter_config.json").write_text(json.dumps(config | {"r": rank}))
        answer = httpx.post(url + "/update_weights", json={"path": str(no_bias_key)}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert_serves(url, first_merged)


@pytest.mark.parametrize("base_on_cpu", [False, True], ids=["base_on_device", "base_on_cpu"])
def test_colocated_adapters_are_merged_onto_the_base(trainer: Trainer, base_on_cpu: bool) -> None:
    with server(trainer.base, "colocated", trainer, base_on_cpu) as (url, sender):
        for version, seed in enumerate((3, 4), start=1):
            _, merged = trainer.adapter(seed=seed)
            answer = stream(url, sender, trainer, version=version)
            assert answer.status_code == 200 and answer.json()["weight_version"] == version, answer.text
            assert_serves(url, merged)
