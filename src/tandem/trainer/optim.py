"""AdamW, the learning-rate schedule and gradient clipping, shared by the SFT and RL trainers."""

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from tandem.models.parallelism import drop_gathered_weights
from tandem.trainer.config import OptimConfig
from tandem.trainer.master_weights import MasterAdamW, local


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; weight decay on parameters with ≥ 2 dimensions only.

    master_weights = "model": torch's AdamW, fused (one kernel per step) on CUDA when every
    parameter lives on one device mesh; foreach otherwise: fused AdamW takes a single mesh per
    call, and expert-parallel weights live on another mesh than the dense ones
    (models/parallelism.py). "optimizer": MasterAdamW (trainer/master_weights.py) over a model
    built with the same setting (trainer/model.py), which holds the fp32 masters and the moments in
    cfg.moments_dtype."""
    keeps_gathered = getattr(model, "keeps_gathered_weights", False)  # (reshard_after_forward = false)
    if keeps_gathered:  # a forward may have left the gathered weights registered in the shards' place
        drop_gathered_weights(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.master_weights == "optimizer":
        moments = getattr(torch, cfg.moments_dtype)
        units = _step_units(model, params) if cfg.overlap_step else None
        optimizer: torch.optim.Optimizer = MasterAdamW(
            groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, moments_dtype=moments, units=units
        )
        if units is not None:
            model.weights_barrier = optimizer.step_stream.barrier
            model.register_state_dict_pre_hook(lambda *_: optimizer.settle())
    else:
        meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
        fused = all(p.is_cuda for p in params) and len(meshes) <= 1
        optimizer = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused, foreach=not fused
        )
    if keeps_gathered:
        optimizer.register_step_post_hook(lambda *_: drop_gathered_weights(model))
    return optimizer


def _step_units(model: nn.Module, params: list[nn.Parameter]) -> list[list[nn.Parameter]] | None:
    """The model's weight units (trainer/step_stream.py) where the step can run on a stream of
    its own: a tandem model on one CUDA device, not wrapped by FSDP (whose gathers read the
    weights on streams of their own), every trainable parameter in one unit; None elsewhere."""
    if not hasattr(model, "weight_units") or isinstance(model, FSDPModule):
        return None
    if not all(p.is_cuda for p in params) or len({p.device for p in params}) != 1:
        return None
    trainable = set(params)
    units = [[p for p in unit if p in trainable] for unit in model.weight_units()]
    return units if {p for unit in units for p in unit} == trainable else None


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


def gradient(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer's next step uses for `param` (before clipping); None if none."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.gradient(param)
    return param.grad


def _local_grads(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, this rank's shard of its gradient) for each gradient the next step uses, in the
    order of the optimizer's parameters (the same on every rank)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if isinstance(optimizer, MasterAdamW):
        return [(p, optimizer.grads[p]) for p in params if p in optimizer.grads]
    return [(p, local(p.grad)) for p in params if p.grad is not None]


def clip_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Global norm of the gradients the optimizer's next step uses, over all ranks' shards; they
    are scaled down to `max_norm` if set (MasterAdamW: by its step, as it reads them).

    The squares are summed in fp32 from each rank's local shards (MasterAdamW's gradients may be
    bf16) and reduced over the mesh dimensions the parameter is sharded on; expert-parallel
    weights live on another mesh than the dense ones (models/parallelism.py), so each mesh is
    reduced on its own. Returns the full (unsharded) norm on every rank as a 0-dim tensor: read it
    after the optimizer step, so the step is queued without waiting for the device.
    """
    grads = _local_grads(optimizer)
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for param, grad in grads:
        key = (None, ())
        if isinstance(param, DTensor):
            key = (param.device_mesh, tuple(i for i, pl in enumerate(param.placements) if pl.is_shard()))
        groups[key].append(grad)
    device = grads[0][1].device if grads else torch.device("cpu")
    total = torch.zeros((), device=device)
    for (mesh, dims), shards in groups.items():
        square = torch.stack(torch._foreach_norm(shards, 2, dtype=torch.float32)).square().sum()
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(square, group=mesh.get_group(dim))
        total += square
    total = total.sqrt()
    if max_norm > 0 and grads:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if isinstance(optimizer, MasterAdamW):
            optimizer.scale_grads(scale)
        else:
            torch._foreach_mul_([grad for _, grad in grads], scale)
    return total
