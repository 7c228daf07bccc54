"""Load new weights into the live model: a Hugging Face safetensors directory, or the tensors of
an in-memory transfer (tandem.transport.weight_receiver).

`read_checkpoint` runs off the engine thread: it opens every file, checks names, shapes and
dtypes against the model and converts to the model's dtype. Only a checkpoint that passed all
checks reaches `apply_checkpoint`, which copies it in between two engine steps. A transfer is
checked by its handshake against `parameter_specs` before its first tensor arrives; its tensors
reach `apply_checkpoint` as they come, so a transfer that fails midway leaves the model mixing
two versions (its error is then marked `partial`).
"""

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.inference.engine.api import WeightLoadError
from tandem.transport.weight_buckets import TensorSpec
from tandem.transport.weight_link import TransferError


def expected_parameters(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The model's tensors by checkpoint name, and the names a checkpoint may leave out (tied).
    An engine model names them itself (`checkpoint_tensors`: FP8 layers hold slots that quantize
    what is copied into them, fp8.py)."""
    tensors = getattr(model, "checkpoint_tensors", None)
    params = dict(tensors() if tensors is not None else model.state_dict())
    optional = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    return params, optional


def read_checkpoint(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_dir():
        raise WeightLoadError(f"weights directory '{path}' does not exist")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in '{path}'")
    params, optional = expected_parameters(model)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensors[name] = handle.get_tensor(name)
        except Exception as e:  # safetensors raises several types for corrupt files
            raise WeightLoadError(f"cannot read '{file}': {e}") from None
    unknown = sorted(set(tensors) - set(params))
    missing = sorted(set(params) - set(tensors) - optional)
    if unknown or missing:
        raise WeightLoadError(
            f"checkpoint '{path}' does not match the model: "
            f"missing {_names(missing)}; unexpected {_names(unknown)}"
        )
    for name, tensor in tensors.items():
        target = params[name]
        if tensor.shape != target.shape:
            raise WeightLoadError(
                f"'{name}' in '{path}' has shape {tuple(tensor.shape)}, the model needs {tuple(target.shape)}"
            )
        if not tensor.is_floating_point():
            raise WeightLoadError(f"'{name}' in '{path}' has dtype {tensor.dtype}, expected floating point")
        tensors[name] = tensor.to(target.dtype)
    return tensors


def parameter_specs(model: torch.nn.Module) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    """What a transfer must carry: every tensor's name, shape and dtype; and the names it may omit."""
    params, optional = expected_parameters(model)
    specs = {name: TensorSpec(name, tuple(t.shape), t.dtype) for name, t in params.items()}
    return specs, frozenset(optional)


def apply_checkpoint(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy checked tensors (a mapping, or (name, tensor) pairs as a transfer yields them) into the model."""
    params, _ = expected_parameters(model)
    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    copied = 0
    try:
        with torch.no_grad():
            for name, tensor in pairs:
                params[name].copy_(tensor, non_blocking=True)
                copied += 1
    except TransferError as e:
        e.partial = copied > 0
        raise
    if any(p.is_cuda for p in params.values()):
        torch.cuda.synchronize()


def version_from_path(path: Path) -> int | None:
    """`.../step_12` → 12; None if the directory is not named step_N."""
    match = re.fullmatch(r"step_(\d+)", Path(path).name)
    return int(match.group(1)) if match else None


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:3])
    return f"{shown} (+{len(names) - 3} more)" if len(names) > 3 else shown
