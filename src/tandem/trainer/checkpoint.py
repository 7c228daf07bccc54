"""Hugging Face model export and exact-resume checkpoints for sharded (FSDP2) trainers.

    run_dir/checkpoints/step_N/
        config.json, model.safetensors, tokenizer files   the model, loadable by transformers
        trainer_state.pt     optimizer (full state dict), scheduler, step, caller's extra state
        rng_rank_R.pt        each rank's torch (and CUDA) RNG state

A checkpoint is written into `.tmp_step_N/` and renamed into place by rank 0 once every rank
has finished, so a directory named `step_N` is always complete. Resume loads the model from the
checkpoint directory itself (it is a Hugging Face model) and then `load_trainer_state` restores
the rest, resharding the full optimizer state onto however many ranks there are now.
"""

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.models.loading import save_model
from tandem.trainer.parallel import World, barrier
from tandem.transport.resume import checkpoint_steps

FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
TRAINER_STATE = "trainer_state.pt"


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights gathered on CPU, without the copies of tied weights (e.g. lm_head.weight).

    Gathered from several ranks, tied parameters come back as separate tensors, which
    save_pretrained would then write twice; a 1-rank gather shares storage and omits them.
    """
    state = get_model_state_dict(model, options=FULL_ON_CPU)
    for tied in getattr(model, "all_tied_weights_keys", {}):
        state.pop(tied, None)
    return state


def write_hf_model(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path, world: World) -> None:
    """Gather full weights onto rank 0 and write a Hugging Face model to `out_dir` atomically.

    Collective: every rank must call it. An existing `out_dir` is replaced.
    """
    state = full_model_state(model)
    if world.is_main:
        tmp = _tmp_dir(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tokenizer, tmp, state_dict=state)
        _replace(tmp, out_dir)
    barrier()


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tokenizer: PreTrainedTokenizerBase,
    world: World,
    extra: dict[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Write `root/step_{step}` (collective); keep only the newest `keep` checkpoints if keep > 0."""
    final = Path(root) / f"step_{step}"
    tmp = _tmp_dir(final)
    model_state = full_model_state(model)
    optim_state = get_optimizer_state_dict(model, optimizer, options=FULL_ON_CPU)
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tokenizer, tmp, state_dict=model_state)
        trainer_state = {
            "step": step,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "extra": extra or {},
        }
        torch.save(trainer_state, tmp / TRAINER_STATE)
    barrier()
    torch.save(_rng_state(), tmp / f"rng_rank_{world.rank}.pt")
    barrier()
    if world.is_main:
        _replace(tmp, final)
        if keep > 0:
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    return [Path(root) / f"step_{step}" for step in checkpoint_steps(root)]


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def load_trainer_state(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    world: World,
) -> tuple[int, dict[str, Any]]:
    """Restore optimizer, scheduler and RNG from a checkpoint; returns (step, extra state).

    The model weights come from loading `path` as a Hugging Face model before sharding.
    """
    state = torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=False)
    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True)
    )
    scheduler.load_state_dict(state["scheduler"])
    rng_file = Path(path) / f"rng_rank_{world.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(state["step"]), dict(state["extra"])


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tmp_dir(final: Path) -> Path:
    return final.parent / f".tmp_{final.name}"


def _replace(tmp: Path, final: Path) -> None:
    """Move a finished `tmp` directory to `final`, replacing an older `final` if present."""
    if final.exists():
        old = final.parent / f".old_{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
