"""The trainer's weights as Hugging Face tensors, one at a time: what the weight transports
(tandem.transport.weight_sender) send and what Hugging Face exports (trainer/hf_export.py) write.

`iter_hf_weights(model, dtype)` yields (Hugging Face name, full tensor cast to `dtype`) in module
order, so one decoder layer after another, each full tensor formed from its FSDP2 shards
(`DTensor.full_tensor()`, an all-gather) just before it is yielded. It is collective: every rank
must iterate it to the end, in step. Every rank receives the full tensors (the all-gather leaves
them on all ranks); a rank that sends nothing drops them at once.

For tandem's own models the family's state-dict adapter splits each parameter into the
checkpoint's tensors (fused q/k/v into q_proj, k_proj, v_proj; stacked experts into one tensor
per expert), so the names and shapes are those of a published checkpoint. For transformers'
models (model.impl = "hf") the parameters and persistent buffers (a router's score-correction
bias) go by their module names, except where transformers' loader converted the checkpoint's
tensors (its MoE models fuse the experts): those are gathered whole, then put back into the
checkpoint's names and shapes by transformers' own reverse conversion. Copies of tied weights
(the output head when it shares the embedding) are skipped: servers tie them themselves.

`hf_weight_specs(model, dtype)` lists the same names, shapes and dtype without gathering anything
(the transports send it ahead of the tensors). The two agree tensor for tensor; the sender
checks each yielded tensor against its spec.

With LoRA (models/lora.py) the full weights are the merged ones, W + (alpha / r)·B·A, and
`iter_adapter_weights` / `adapter_weight_specs` are the same pair over the adapters alone, in
PEFT's names (what a weight update carries then).
"""

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tandem.models.hf_checkpoint import Layout, expected_sources, split_full
from tandem.models.layers.transformer import CausalLM
from tandem.models.lora import adapter_layouts, is_adapter_tensor, lora_layers
from tandem.models.registry import family
from tandem.trainer.step_stream import settle_weights
from tandem.transport.weight_buckets import TensorSpec


def persistent_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (LoRA adapters included): what a checkpoint holds."""
    settle_weights(model)  # (the readers of these tensors: an optimizer step must be done)
    tensors = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                tensors[f"{module_name}.{name}" if module_name else name] = buffer
    return tensors


def hf_layouts(model: CausalLM) -> dict[str, Layout]:
    return family(model.hf_config.model_type).hf_layout(model.hf_config)


def _base_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the checkpoint's model, by the trainer's names (no adapters). A transformers
    model's shared parameters come once, under their first name, and tied copies not at all."""
    named = persistent_tensors(model).items()  # (a shared parameter: one entry)
    if not isinstance(model, CausalLM):
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        named = [(n, t) for n, t in named if n not in tied]
    return ((n, t) for n, t in named if not is_adapter_tensor(n))


def _converted(model: nn.Module) -> bool:
    """A transformers model whose loader changed the checkpoint's tensors (fused its experts)."""
    return not isinstance(model, CausalLM) and bool(getattr(model, "_weight_conversions", None))


def _as_checkpoint(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A converted transformers model's tensors under the checkpoint's names and shapes."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _specs(
    named: Iterator[tuple[str, torch.Tensor]], layouts: dict | None, dtype: torch.dtype
) -> list[TensorSpec]:
    if layouts is None:
        return [TensorSpec(name, tuple(t.shape), dtype) for name, t in named]
    return [
        TensorSpec(name, shape, dtype)
        for own, tensor in named
        for name, shape in expected_sources(layouts[own], tuple(tensor.shape))
    ]


def hf_weight_specs(model: nn.Module, dtype: torch.dtype) -> list[TensorSpec]:
    if _converted(model):
        shapes = {n: torch.empty(t.shape, device="meta") for n, t in _base_tensors(model)}
        return _specs(iter(_as_checkpoint(model, shapes).items()), None, dtype)
    layouts = hf_layouts(model) if isinstance(model, CausalLM) else None
    return _specs(_base_tensors(model), layouts, dtype)


def _adapters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, layer in lora_layers(model).items():
        yield f"{name}.lora_a", layer.lora_a
        yield f"{name}.lora_b", layer.lora_b


def adapter_weight_specs(model: nn.Module, dtype: torch.dtype) -> list[TensorSpec]:
    return _specs(_adapters(model), adapter_layouts(model), dtype)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor. A mesh of one rank holds it whole already; skipping the collective there
    saves ~0.5 ms of dispatch per parameter (~150 ms for a 28-layer model)."""
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    if tensor.device_mesh.size() == 1:
        return tensor.to_local().detach()
    return tensor.full_tensor()


@torch.no_grad()
def iter_hf_weights(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """See the module docstring. dtype None keeps the weights' own; `of` picks what to gather for
    each tensor instead of the tensor itself (its gradient, say; None skips it; nothing is merged)."""
    layouts = hf_layouts(model) if isinstance(model, CausalLM) else None
    merged = {f"{name}.weight": layer for name, layer in lora_layers(model).items()} if of is None else {}
    converted: dict[str, torch.Tensor] | None = {} if _converted(model) else None
    for name, tensor in _base_tensors(model):
        picked = tensor if of is None else of(tensor)
        if picked is None:
            continue
        full = _full(picked)
        if name in merged:
            layer = merged[name]
            full = layer.merged_weight(full, layer.delta_weight(_full(layer.lora_a), _full(layer.lora_b)))
        full = full if dtype is None else full.to(dtype)
        if converted is not None:
            converted[name] = full  # (converted back all together, below)
        else:
            yield from _split(layouts, name, full)
    if converted is not None:
        yield from _as_checkpoint(model, converted).items()


def _split(layouts: dict | None, name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if layouts is None:
        yield name, full
    else:
        yield from split_full(layouts[name], full)


@torch.no_grad()
def iter_adapter_weights(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The LoRA adapters as PEFT's tensors, full (collective, like iter_hf_weights)."""
    layouts = adapter_layouts(model)
    for name, tensor in _adapters(model):
        full = _full(tensor)
        yield from _split(layouts, name, full if dtype is None else full.to(dtype))
