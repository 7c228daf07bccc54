"""Exact-resume checkpoints for sharded (FSDP2) trainers, through torch.distributed.checkpoint.

    run_dir/checkpoints/step_N/
        dcp/                 model and optimizer state, sharded: each rank writes its own shards
        trainer_state.pt     scheduler, step and the caller's extra state (rank 0)
        rng_rank_R.pt        each rank's torch (and CUDA) RNG state

A checkpoint is written into `.tmp_step_N/` and renamed into place by rank 0 once every rank
has finished, so a directory named `step_N` is always complete. Resume builds the model as
usual without reading its weights and loads model and optimizer from `dcp/`; DCP reshards on
load, so a run can resume on a different number of ranks. Hugging Face exports of the model
are written separately (trainer/hf_export.py). Frozen parameters (the base under LoRA) are not
saved: they are the model's own checkpoint, which a resume loads first.

Before loading, a resume compares the checkpoint's tensors (names and shapes, from DCP's
metadata) with the model's and optimizer's, and a model that no longer matches (another model,
LoRA switched on or off, another rank or targets) fails in one line naming the checkpoint and
the first tensor that differs. Same shapes are not enough under LoRA: trainer_state.pt records the
adapters' lora.alpha and the base model they were trained on (trainer/base_identity.py), and a
resume with another alpha or another base is refused in one line as well, before the shards load.
"""

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tandem.cli import UserError
from tandem.trainer.base_identity import RECORD as BASE_RECORD
from tandem.trainer.base_identity import check_base
from tandem.trainer.parallel import World, barrier
from tandem.trainer.step_stream import settle_weights
from tandem.transport.layout import checkpoint_dir, checkpoint_steps

FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
TRAINER_STATE = "trainer_state.pt"
SHARDS = "dcp"


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of a transformers model gathered on CPU, without the copies of tied weights.

    Gathered from several ranks, tied parameters come back as separate tensors, which
    save_pretrained would then write twice; a 1-rank gather shares storage and omits them.
    """
    state = get_model_state_dict(model, options=FULL_ON_CPU)
    for tied in getattr(model, "all_tied_weights_keys", {}):
        state.pop(tied, None)
    return state


def _trained(model: nn.Module) -> StateDictOptions:
    """What a checkpoint holds: the parameters that train (all of them but under LoRA)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    settle_weights(model)  # (saved from, or loaded into: no optimizer step may still be running)
    options = _trained(model)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    world: World,
    extra: dict[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Write `root/step_{step}` (collective); keep only the newest `keep` checkpoints if keep > 0."""
    final = checkpoint_dir(root, step)
    tmp = tmp_dir(final)
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=tmp / SHARDS)
    if world.is_main:
        trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "extra": extra or {}}
        trainer_state["lora_alpha"] = getattr(model, "adapter_config", {}).get("lora_alpha")
        trainer_state[BASE_RECORD] = getattr(model, "base_identity", None)  # (LoRA: the base it trains on)
        torch.save(trainer_state, tmp / TRAINER_STATE)
    torch.save(_rng_state(), tmp / f"rng_rank_{world.rank}.pt")
    barrier()
    if world.is_main:
        replace_dir(tmp, final)
        if keep > 0:
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    return [checkpoint_dir(root, step) for step in checkpoint_steps(root)]


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def checkpoint_to_resume(root: Path, resume: bool, world: World, who: str) -> Path | None:
    """With `resume`, the newest complete checkpoint under `root`; None when not resuming, or when
    the run stopped before its first checkpoint (rank 0 then says it trains again from step 0)."""
    found = latest_checkpoint(root) if resume else None
    if resume and found is None and world.is_main:
        print(f"{who}: no checkpoint in {root} yet: training again from step 0", flush=True)
    return found


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    world: World,
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer, scheduler and RNG from a checkpoint; returns (step, extra state).
    A checkpoint that does not fit the model fails first (UserError, one line)."""
    state = _sharded_state(model, optimizer)
    check_fits(Path(path), state)
    trainer_state = torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=False)
    check_base(Path(path), trainer_state.get(BASE_RECORD), getattr(model, "base_identity", None), world)
    alpha, saved_alpha = (
        getattr(model, "adapter_config", {}).get("lora_alpha"),
        trainer_state.get("lora_alpha"),
    )
    if saved_alpha is not None and alpha != saved_alpha:  # (same shapes: the adapters' scale would change)
        raise UserError(
            f"cannot resume from {path}: it was trained with lora.alpha = {saved_alpha:g}, the run sets {alpha:g}"
        )
    dcp.load(state, checkpoint_id=Path(path) / SHARDS)
    set_model_state_dict(model, state["model"], options=_trained(model))
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"], options=_trained(model))
    scheduler.load_state_dict(trainer_state["scheduler"])
    rng_file = Path(path) / f"rng_rank_{world.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(trainer_state["step"]), dict(trainer_state["extra"])


CHANGED = "the model, LoRA (on or off, rank, targets) or optim.master_weights changed since it was written?"


def check_fits(path: Path, state: dict[str, Any]) -> None:
    """Fail (UserError) naming `path` and the first tensor of the model or optimizer `state` that
    the checkpoint lacks or holds in another shape, or the first model tensor it holds that the
    model has not. (DCP itself fails on these with a traceback per rank.)"""
    try:
        saved = dcp.FileSystemReader(path / SHARDS).read_metadata().state_dict_metadata
    except Exception as e:  # a missing or unreadable .metadata: whatever the reader raises
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot resume from {path}: {path / SHARDS} cannot be read ({line})") from None
    wanted = dict(_flat_tensors(state))
    for key, tensor in wanted.items():
        found = saved.get(key)
        if found is None:
            raise UserError(f"cannot resume from {path}: the checkpoint has no {key} ({CHANGED})")
        if isinstance(found, TensorStorageMetadata) and tuple(found.size) != tuple(tensor.shape):
            raise UserError(
                f"cannot resume from {path}: {key} is {list(found.size)} in the checkpoint, "
                f"{list(tensor.shape)} in the model ({CHANGED})"
            )
    extra = [key for key in saved if key.startswith("model.") and key not in wanted]
    if extra:
        raise UserError(
            f"cannot resume from {path}: the checkpoint holds {extra[0]}, which the model has not ({CHANGED})"
        )


def _flat_tensors(state: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a nested state dict under DCP's names (keys joined by "."), model first;
    lists (the optimizer's param_groups) are not descended into."""
    found = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.extend(_flat_tensors(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            found.append((name, value))
    return found


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def tmp_dir(final: Path) -> Path:
    return Path(final).parent / f".tmp_{Path(final).name}"


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished `tmp` directory to `final`, replacing an older `final` if present."""
    if final.exists():
        old = final.parent / f".old_{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
