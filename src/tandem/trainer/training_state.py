"""What both trainers (SFT and RL) build before their first step: the model, its optimizer and
LR schedule, restored from a resume checkpoint where there is one."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from tandem.config.base import ModelConfig
from tandem.trainer.checkpoint import load_checkpoint
from tandem.trainer.config import LoRAConfig, OptimConfig, ParallelConfig
from tandem.trainer.model import build_trainer_model, lora_enabled
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.parallel import World


class TrainerSettings(Protocol):
    """The fields of a trainer's config (SFTConfig, RLTrainerConfig) read here."""

    model: ModelConfig
    parallel: ParallelConfig
    compute_dtype: str
    lora: LoRAConfig | None
    seed: int
    optim: OptimConfig
    max_steps: int


@dataclass
class TrainingState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    step: int  # the first step to train: 0, or the resumed checkpoint's
    extra: dict[str, Any]  # what the trainer saved beside it (save_checkpoint's `extra`); {} when fresh


def build_training_state(cfg: TrainerSettings, world: World, resume_from: Path | None) -> TrainingState:
    """The model (its weights loaded unless a checkpoint brings them; LoRA's base is always
    loaded, as checkpoints hold only the adapters), optimizer and schedule, and, with
    `resume_from`, their state restored from that checkpoint."""
    model = build_trainer_model(
        cfg.model,
        world,
        cfg.parallel,
        cfg.compute_dtype,
        load_weights=not resume_from or lora_enabled(cfg.lora),
        lora=cfg.lora,
        seed=cfg.seed,
        master_weights=cfg.optim.master_weights,
    )
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.max_steps)
    step, extra = load_checkpoint(resume_from, model, optimizer, scheduler, world) if resume_from else (0, {})
    return TrainingState(model, optimizer, scheduler, step, extra)
