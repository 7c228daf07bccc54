"""How the RL trainer hands each policy version to the inference servers (`[weights] transport`).

filesystem: every version is written as `weights/step_N` (STABLE last); the servers load it.
broadcast / colocated: a `WeightSender` streams it out of the trainer's memory; `weights/step_N`
is still written every `export_interval` steps and after the last step, for serving and
evaluation. The orchestrator decides when the servers take a version (docs/weights.md); the
trainer's `publish` returns once every server holds it.

With LoRA a version is the adapters alone, both ways: `weights/step_N` is a PEFT adapter
directory, and a stream carries the adapter tensors with its adapter_config as the offer's meta;
the servers merge them onto their base weights (or load them as a LoRA adapter, vLLM).
"""

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.cli import UserError
from tandem.models.lora import has_lora
from tandem.trainer.parallel import World
from tandem.trainer.weight_stream import (
    adapter_weight_specs,
    hf_weight_specs,
    iter_adapter_weights,
    iter_hf_weights,
)
from tandem.transport.config import WeightsConfig
from tandem.transport.weight_buckets import TensorSpec
from tandem.transport.weight_link import LinkError, LinkSettings, TransferError
from tandem.transport.weight_sender import WeightSender
from tandem.transport.weights import clear_offer, publish_weights, write_offer


class PolicyPublisher:
    def __init__(
        self,
        cfg: WeightsConfig,
        run_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        world: World,
        max_steps: int,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.tokenizer = tokenizer
        self.world = world
        self.max_steps = max_steps
        self.sender: WeightSender | None = None
        if cfg.in_memory:
            settings = _guarded(lambda: LinkSettings.of(cfg))
            self.sender = WeightSender(settings, cfg.num_servers, world.rank, world.size, world.device)

    def start(self, model: nn.Module, version: int) -> None:
        """Meet the servers (in-memory transports); a resumed run then sends its current version:
        the servers start from the base model."""
        if self.sender is None:
            return
        sender = self.sender
        if self.world.is_main:
            clear_offer(self.run_dir)
        dtype = _guarded(lambda: sender.connect(lambda d: update_stream(model, d)[0]))
        if self.world.is_main:
            print(f"trainer: weights by {self.cfg.transport} ({sender.describe()}; {dtype})", flush=True)
        if 0 < version < self.max_steps:  # (a finished run has nothing left to train, nobody to take it)
            self._send(model, version)

    def publish(self, model: nn.Module, version: int) -> None:
        """Hand policy `version` to the servers (collective over the trainer's ranks)."""
        if self.sender is None:
            publish_weights(model, self.tokenizer, self.run_dir, version, self.world, self.cfg.keep)
            return
        self._send(model, version)
        interval = self.cfg.export_interval
        if version == self.max_steps or (interval and version % interval == 0):
            publish_weights(model, self.tokenizer, self.run_dir, version, self.world, self.cfg.keep)

    def _send(self, model: nn.Module, version: int) -> None:
        sender = self.sender
        assert sender is not None
        specs, tensors, meta = update_stream(model, sender.dtype)
        announce = lambda v: write_offer(self.run_dir, v)  # noqa: E731
        _guarded(lambda: sender.send(version, specs, tensors, announce, meta))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def update_stream(model: nn.Module, dtype: torch.dtype) -> tuple[list[TensorSpec], Iterator, dict]:
    """What one update carries: specs, the tensors (a collective iterator) and the offer's meta.
    Adapters travel in float32 whatever the serving dtype (they are small; the server merges them
    in float32)."""
    if has_lora(model):
        meta = {"adapter_config": model.adapter_config}
        return adapter_weight_specs(model, torch.float32), iter_adapter_weights(model, torch.float32), meta
    return hf_weight_specs(model, dtype), iter_hf_weights(model, dtype), {}


def _guarded(call):  # type: ignore[no-untyped-def]
    """A failed link or transfer is the run's end: one line naming side and step, not a traceback."""
    try:
        return call()
    except (TransferError, LinkError) as e:
        raise UserError(str(e)) from None
