"""AdamW, the learning-rate schedule and gradient clipping, shared by the SFT and RL trainers."""

import math
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from tandem.models.parallelism import drop_gathered_weights
from tandem.trainer.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over trainable parameters; weight decay on parameters with ≥ 2 dimensions only.

    Fused (one kernel per step) on CUDA when every parameter lives on one device mesh; foreach
    otherwise: fused AdamW takes a single mesh per call, and expert-parallel weights live on
    another mesh than the dense ones (models/parallelism.py)."""
    keeps_gathered = getattr(model, "keeps_gathered_weights", False)  # (reshard_after_forward = false)
    if keeps_gathered:  # a forward may have left the gathered weights registered in the shards' place
        drop_gathered_weights(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    fused = all(p.is_cuda for p in params) and len(meshes) <= 1
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=fused,
        foreach=not fused,
    )
    if keeps_gathered:
        optimizer.register_step_post_hook(lambda *_: drop_gathered_weights(model))
    return optimizer


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of cfg.lr for the optimizer step that follows `step` completed steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all ranks' shards; gradients are scaled down to `max_norm` if set.

    FSDP2 gradients are DTensors; their norm reduces across the mesh. Expert-parallel weights
    live on another mesh than the dense ones (models/parallelism.py), and torch's clipping needs
    one mesh per call, so the norm is taken per mesh and combined; the returned norm is the
    full (unsharded) one on every rank, as a 0-dim tensor: read it after the optimizer step, so
    the step is queued without waiting for the device.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
