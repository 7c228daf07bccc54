"""LoRA adapters on the trainer's linear layers, tandem's models and transformers' alike.

A targeted linear layer W (frozen) computes

    y = W·x + b + (alpha / r)·B·A·dropout(x)          A [r, in] (kaiming-uniform), B [out, r] (zeros)

which is what PEFT's LoRA computes for one `nn.Linear`. tandem's models fuse several checkpoint
projections into one matmul (q|k|v, gate|up); there each projection the targets name keeps an
adapter of its own, exactly as PEFT gives the separate modules of the transformers model:
`LoRALinear` holds the A of every adapted part stacked ([parts·r, in], one matmul) and their
B stacked by rows, applied block-diagonally. So a saved adapter is a PEFT adapter of the
transformers base model, whichever implementation trained it (`adapter_layouts` names each
part's tensors as PEFT does: `base_model.model.<module>.lora_A.weight`, `...lora_B.weight`).

Invariants: a base parameter keeps its name and object (checkpoints, the state-dict adapters
and FSDP see the model as without LoRA, plus `*.lora_a` / `*.lora_b`); base parameters are frozen
and the adapters are float32 whatever the base dtype; adapters are injected before FSDP shards
the model, so they are sharded with the rest of their block. Not adapted: the output head (the
trainer's logprobs read its weight directly), the embedding and MoE experts (not linear layers).
"""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.hf_checkpoint import Concat, Layout, Source

PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


@dataclass(frozen=True)
class Part:
    """One checkpoint projection inside a trainer linear layer: its Hugging Face module name
    and its rows of the layer's output."""

    module: str
    start: int
    rows: int


def matches_target(name: str, targets: list[str] | str) -> bool:
    """PEFT's rule: a regular expression matches the whole name; a list entry equals the name
    or its last dotted components."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith("." + t) for t in targets)


class LoRALinear(nn.Linear):
    """A linear layer with low-rank adapters on some of its parts (see the module docstring).

    It takes over the base layer's `weight` and `bias` objects, so their names do not change."""

    def __init__(
        self, base: nn.Linear, parts: list[Part], adapted: list[Part], rank: int, alpha: float, dropout: float
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.parts, self.adapted = parts, adapted
        self.rank, self.scale = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        factory = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_a = nn.Parameter(torch.zeros(len(adapted) * rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(sum(p.rows for p in adapted), rank, **factory))
        self.covers_all = [(p.start, p.rows) for p in adapted] == [(p.start, p.rows) for p in parts]

    def delta_weight(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(alpha / r)·B·A over the adapted parts' rows, [adapted rows, in], from the full adapters."""
        blocks = torch.block_diag(*b.float().split([p.rows for p in self.adapted]))
        return self.scale * (blocks @ a.float())

    def merged_weight(self, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The full `weight` (of this layer's shape) with `delta` added to the adapted parts' rows."""
        merged = weight.float().clone()
        offset = 0
        for part in self.adapted:
            merged[part.start : part.start + part.rows] += delta[offset : offset + part.rows]
            offset += part.rows
        return merged.to(weight.dtype)

    def effective_weight(self) -> torch.Tensor:
        """W + (alpha / r)·B·A, differentiable in the adapters: for code that applies the weight
        itself instead of calling the layer (GLM-5's sparse attention absorbs kv_b_proj into its
        queries). Dropout on the adapters' input has no place there: refused while training."""
        if self.training and not isinstance(self.dropout, nn.Identity):
            raise ValueError(
                "lora.dropout > 0 cannot apply to a layer whose weight is absorbed into other products "
                "(GLM-5's kv_b_proj under sparse attention): set lora.dropout = 0 or leave kv_b_proj out"
            )
        return self.merged_weight(self.weight, self.delta_weight(self.lora_a, self.lora_b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.linear(self.dropout(x), self.lora_a.to(x.dtype))
        b = self.lora_b.to(x.dtype).split([p.rows for p in self.adapted])
        delta = F.linear(h, torch.block_diag(*b)) * self.scale
        if self.covers_all:
            return out + delta
        pieces = list(out.split([p.rows for p in self.parts], dim=-1))
        index = {p.start: i for i, p in enumerate(self.parts)}
        for part, d in zip(self.adapted, delta.split([p.rows for p in self.adapted], dim=-1), strict=True):
            pieces[index[part.start]] = pieces[index[part.start]] + d
        return torch.cat(pieces, dim=-1)


def linear_parts(layouts: dict[str, Layout] | None, model: nn.Module) -> dict[str, list[Part]]:
    """Every linear layer of `model` by its module name, with the checkpoint projections it holds.

    `layouts` is the family's state-dict adapter (tandem's models); None for a transformers
    model, whose linear layers are the checkpoint's modules themselves."""
    found: dict[str, list[Part]] = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if layouts is None:
            found[name] = [Part(name, 0, module.out_features)]
            continue
        layout = layouts.get(f"{name}.weight")
        sources = [layout] if isinstance(layout, Source) else list(getattr(layout, "parts", []))
        if not sources or not all(isinstance(s, Source) for s in sources):
            continue
        sizes = layout.sizes if isinstance(layout, Concat) else (module.out_features,)
        parts, start = [], 0
        for source, rows in zip(sources, sizes, strict=True):
            parts.append(Part(source.name.removesuffix(".weight"), start, rows))
            start += rows
        found[name] = parts
    return found


def inject_lora(
    model: nn.Module,
    parts: dict[str, list[Part]],
    targets: list[str] | str,
    rank: int,
    alpha: float,
    dropout: float,
    head: str,
) -> list[str]:
    """Freeze `model` and put adapters on the linear layers whose parts `targets` names; returns
    the adapted Hugging Face module names. Raises ValueError (one line) when nothing matches or
    the output head (`head`, its Hugging Face module name) does."""
    model.requires_grad_(False)
    adapted_names: list[str] = []
    for name, layer_parts in parts.items():
        adapted = [p for p in layer_parts if matches_target(p.module, targets)]
        if not adapted:
            continue
        if any(p.module == head for p in adapted):
            raise ValueError(f"lora.target_modules {targets!r} matches the output head {head}, "
                             "which LoRA does not adapt")  # fmt: skip
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), layer_parts, adapted, rank, alpha, dropout))
        adapted_names += [p.module for p in adapted]
    if not adapted_names:
        example = next((p.module for ps in parts.values() for p in ps), "none")
        raise ValueError(
            f"lora.target_modules {targets!r} matches no linear module of the model "
            f"(Hugging Face names, e.g. {example})"
        )
    return adapted_names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def is_adapter_tensor(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_layouts(model: nn.Module) -> dict[str, Layout]:
    """Each adapter parameter (`<layer>.lora_a` / `.lora_b`) as the PEFT tensors it is made of."""
    layouts: dict[str, Layout] = {}
    for name, layer in lora_layers(model).items():
        a = [Source(f"{PEFT_PREFIX}{p.module}.lora_A.weight") for p in layer.adapted]
        b = [Source(f"{PEFT_PREFIX}{p.module}.lora_B.weight") for p in layer.adapted]
        layouts[f"{name}.lora_a"] = Concat(tuple(a), (layer.rank,) * len(a))
        layouts[f"{name}.lora_b"] = Concat(tuple(b), tuple(p.rows for p in layer.adapted))
    return layouts


@torch.no_grad()
def init_lora(model: nn.Module, seed: int, fill_local: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """PEFT's initialisation, A kaiming-uniform and B zero, the same on any number of ranks: each
    full A is drawn from one seeded generator and `fill_local(param, full)` copies this rank's part."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model).values():
        full = torch.empty(tuple(layer.lora_a.shape))
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        fill_local(layer.lora_a, full)
        fill_local(layer.lora_b, torch.zeros(tuple(layer.lora_b.shape)))


def adapter_config(
    base_model: str, rank: int, alpha: float, dropout: float, targets: list[str] | str
) -> dict[str, object]:
    """adapter_config.json of PEFT's LoRA for a causal LM (what `peft` and vLLM read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
