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
models (model.impl = "hf") the parameter names are Hugging Face names already; copies of tied
weights (the output head when it shares the embedding) are skipped: servers tie them themselves.

`hf_weight_specs(model, dtype)` lists the same names, shapes and dtype without gathering anything
(the transports send it ahead of the tensors). The two agree tensor for tensor; the sender
checks each yielded tensor against its spec.
"""

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tandem.models.hf_checkpoint import Layout, expected_sources, split_full
from tandem.models.layers.transformer import CausalLM
from tandem.models.registry import family
from tandem.transport.weight_buckets import TensorSpec


def persistent_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name: what a checkpoint holds."""
    tensors = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                tensors[f"{module_name}.{name}" if module_name else name] = buffer
    return tensors


def hf_layouts(model: CausalLM) -> dict[str, Layout]:
    return family(model.hf_config.model_type).hf_layout(model.hf_config)


def _hf_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    for name, param in model.named_parameters():  # shared parameters come once, under their first name
        if name not in tied:
            yield name, param


def hf_weight_specs(model: nn.Module, dtype: torch.dtype) -> list[TensorSpec]:
    if isinstance(model, CausalLM):
        layouts = hf_layouts(model)
        return [
            TensorSpec(name, shape, dtype)
            for own, tensor in persistent_tensors(model).items()
            for name, shape in expected_sources(layouts[own], tuple(tensor.shape))
        ]
    return [TensorSpec(name, tuple(param.shape), dtype) for name, param in _hf_parameters(model)]


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
    each tensor instead of the tensor itself (its gradient, say; None skips it)."""
    if isinstance(model, CausalLM):
        layouts = hf_layouts(model)
        named = persistent_tensors(model).items()
    else:
        layouts, named = None, _hf_parameters(model)
    for name, tensor in named:
        picked = tensor if of is None else of(tensor)
        if picked is None:
            continue
        full = _full(picked)
        full = full if dtype is None else full.to(dtype)
        if layouts is None:
            yield name, full
        else:
            yield from split_full(layouts[name], full)
