"""LoRA adapters as weight updates of the native engine: merged into the weights, always onto the base.

An adapter is PEFT's layout: `adapter_config.json` (r, lora_alpha, ...) and, for each adapted
module M of the Hugging Face model, `base_model.model.M.lora_A.weight` [r, in] and
`base_model.model.M.lora_B.weight` [out, r] (a directory with `adapter_model.safetensors`, or the
tensors of an in-memory transfer whose offer's meta holds the adapter_config). M's weight becomes

    W = W₀ + (lora_alpha / r)·B·A        in float32, then cast to the weight's dtype

where W₀ is M's weight before the first adapter arrived: the merger copies each weight it adapts
(on the weights' device, or in host memory with `engine.lora_base_on_cpu`) the first time, so every
adapter is merged onto the base and never onto the previous merge. A module an earlier adapter
adapted and the new one does not goes back to W₀. A full-weights update makes its tensors the
new base (the copies are dropped). The merged tensors go through weights.apply_checkpoint like a
checkpoint's, between two engine steps; checks run before anything changes.
"""

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.inference.engine.api import WeightLoadError
from tandem.inference.engine.weights import expected_parameters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the adapter's tensors from a PEFT adapter directory."""
    path = Path(path)
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise WeightLoadError(f"cannot read {path / ADAPTER_CONFIG}: {e}") from None
    try:
        with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises several types for missing and corrupt files
        raise WeightLoadError(f"cannot read {path / ADAPTER_WEIGHTS}: {e}") from None
    return config, tensors


def _split(name: str) -> tuple[str, str] | None:
    """`base_model.model.M.lora_A.weight` → (M's weight name, "A"); None for anything else."""
    if not name.startswith(PREFIX):
        return None
    for suffix, which in SUFFIXES.items():
        if name.endswith(suffix):
            return f"{name[len(PREFIX) : -len(suffix)]}.weight", which
    return None


def scale_of(config: Mapping) -> float:
    rank, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


ABSENT = {"r": None, "lora_alpha": None, "bias": "none"}  # an adapter_config's missing keys (peft's defaults)


class LoRAMerger:
    def __init__(self, model: torch.nn.Module, base_on_cpu: bool = False) -> None:
        self.model = model
        self.base_on_cpu = base_on_cpu
        self.base: dict[str, torch.Tensor] = {}  # weight name → W₀, for every weight adapted so far

    def check(self, config: Mapping, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """Why the adapter (its config and tensor shapes) does not fit the model, or None."""
        for key, ok, what in (
            ("r", lambda v: isinstance(v, int) and v > 0, "a positive rank"),
            ("lora_alpha", lambda v: isinstance(v, (int, float)) and v > 0, "a positive alpha"),
            ("use_dora", lambda v: not v, "plain LoRA (no DoRA)"),
            ("bias", lambda v: v in (None, "none"), "no trained biases"),
            ("rank_pattern", lambda v: not v, "one rank for every module"),
            ("alpha_pattern", lambda v: not v, "one alpha for every module"),
        ):
            if not ok(config.get(key, ABSENT.get(key, False))):
                return f"adapter_config {key} = {config.get(key)!r}: the engine merges {what}"
        params, _ = expected_parameters(self.model)
        rank, found = config["r"], {}
        for name, shape in shapes.items():
            split = _split(name)
            if split is None:
                return (
                    f"{name} is not a LoRA tensor in PEFT's names (base_model.model.<module>.lora_A/B.weight)"
                )
            weight, which = split
            target = params.get(weight)
            if target is None:
                return f"{name}: the model has no {weight} to merge it into"
            if not isinstance(target, torch.Tensor):
                return f"{name}: {weight} is FP8 here; LoRA updates need engine.quantization = 'none'"
            if target.dim() != 2:
                return f"{name}: {weight} is not a linear layer's weight ({list(target.shape)})"
            out, cols = target.shape
            want = (rank, cols) if which == "A" else (out, rank)
            if tuple(shape) != want:
                return f"{name} has shape {list(shape)}, {weight} {list(target.shape)} at rank {rank} needs {list(want)}"
            found.setdefault(weight, set()).add(which)
        lonely = sorted(w for w, parts in found.items() if parts != {"A", "B"})
        if lonely:
            return f"the adapter holds only one of lora_A and lora_B for {lonely[0]}"
        if not found:
            return "the adapter holds no tensors"
        return None

    def merged(
        self, config: Mapping, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(weight name, W₀ + scale·B·A) for each module of a checked adapter, as its A and B arrive
        (a transfer's tensors are views of a bucket: A is copied until its B comes); then W₀ for
        modules adapted before and not now."""
        params, _ = expected_parameters(self.model)
        scale = scale_of(config)
        halves: dict[str, dict[str, torch.Tensor]] = {}
        done: set[str] = set()
        for name, tensor in tensors:
            weight, which = _split(name)  # type: ignore[misc]  # checked before
            target = params[weight]
            halves.setdefault(weight, {})[which] = tensor.to(target.device, torch.float32, copy=True)
            if len(halves[weight]) < 2:
                continue
            half = halves.pop(weight)
            base = self._base(weight, target)
            delta = scale * (half["B"] @ half["A"])
            # device first, then fp32: `.to(cuda, float32)` of a host tensor converts on the CPU
            # into unpinned memory and moves twice the bytes (the likely cause of the 1.7 s updates
            # of a 1.7B model with lora_base_on_cpu in benchmarks/rl_24gb.py; 49 ms with the base on the GPU)
            base = base.to(target.device, non_blocking=True).to(torch.float32)
            yield weight, (base + delta).to(target.dtype)
            done.add(weight)
        for weight in sorted(set(self.base) - done):
            yield weight, self.base[weight]

    def full(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> object:
        """A full-weights update: it becomes the base, so the copies of the old one are dropped."""
        self.base.clear()
        return tensors

    def _base(self, weight: str, live: torch.Tensor) -> torch.Tensor:
        if weight not in self.base:
            copy = live.detach().to("cpu", copy=True) if self.base_on_cpu else live.detach().clone()
            self.base[weight] = copy.pin_memory() if self.base_on_cpu and live.is_cuda else copy
        return self.base[weight]
