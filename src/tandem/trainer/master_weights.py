"""AdamW holding the fp32 master weights: the model's parameters are bf16, the optimizer's copies fp32.

With `[optim] master_weights = "optimizer"` the model's sharded parameters (FSDP2 DTensor shards)
are held in the compute dtype, so FSDP gathers them without casting, and `MasterAdamW` keeps,
per parameter shard, state {"step", "master", "exp_avg", "exp_avg_sq"}: the fp32 master copy and
AdamW's moments, sharded like the parameter. Its step updates master and moments and writes
the parameter, rounded to its dtype, in one pass per tensor (trainer/adamw_kernel.py on CUDA; the
same arithmetic in torch elsewhere). Megatron's recipe: bf16 model parameters, fp32 main
parameters in the optimizer.

The moments are fp32, or with `[optim] moments_dtype = "bfloat16"` bf16: 8 bytes of state a
parameter instead of 12. They are still computed in fp32 and only stored in bf16, rounded
stochastically (trainer/stochastic_round.py: rounded to nearest, exp_avg_sq's 0.1 % steps would
vanish below bf16's resolution), with noise that depends on the step, the tensor (shard) and the
element only, so a run and its resume take the same steps. The masters stay fp32.

Why one Triton pass rather than torch's fused AdamW or a compiled foreach step: fused AdamW
updates its parameters in place and has no second output, so the bf16 parameter would cost a
separate cast (another read of the fp32 master and a write); torch.compile over hundreds of
tensors compiles for minutes and recompiles whenever the list changes. The kernel reads and
writes each tensor once; it launches once per tensor (a few hundred launches a step, queued
while the backward still runs).

Gradients. FSDP reduces each micro-batch's gradient (in fp32 across ranks, nothing to reduce
on one) and casts it back to the parameter's dtype; left on the parameter, the next micro-batch
would then be added to it in bf16. Instead a post-accumulate-grad hook, which FSDP calls after it
assigned a sharded gradient, takes the gradient off the parameter into the optimizer: the first
micro-batch's as it is (no copy; a one-micro-batch step reads bf16 gradients throughout), the
second turns it into an fp32 sum, and later ones are added to that in fp32. So micro-batches
accumulate in fp32, each rounded to bf16 once (a relative error of at most 2^-9 per element,
below the noise of a bf16 backward) — for 1 micro-batch per step this moves 2 bytes a parameter,
for k > 1 about 6 + 10·(k − 1). `gradient(p)` reads them, the parameters' own `.grad` stay None.

Clipping (trainer/optim.py `clip_grad_norm`) measures the norm over these gradients and hands
the coefficient to `scale_grads`; the step multiplies the gradients by it as it reads them.

With `units` (`[optim] overlap_step`, one CUDA GPU) the step runs on a CUDA stream of its own,
unit by unit in the order the next forward reads the weights (trainer/step_stream.py): read the
state after `settle()` (state_dict, load_state_dict and `master` do that).

Invariants: every parameter equals its master rounded to the parameter's dtype after each step
and each `load_state_dict`; the masters are copied from the parameters when the optimizer is
built (a resume then loads them from the checkpoint, exactly), so change the weights through the
optimizer (its state), not the model, afterwards.
"""

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tandem.trainer import stochastic_round
from tandem.trainer.step_stream import StepStream


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` (this rank's part) as a tensor sharded like `param`."""
    if not isinstance(param, DTensor):
        return shard
    return DTensor.from_local(
        shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )


@torch.no_grad()
def adamw_torch_(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scale: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    seed: int = 0,
) -> None:
    """adamw_kernel.adamw_ in torch ops, operation for operation in fp32 (so the two agree bit for
    bit, bf16 moments' stochastic rounding included; the square root is taken in fp64, which
    rounds it correctly like the kernel's, where torch's fp32 one on CPU is off by an ulp)."""
    grad = grad.float() * scale
    master.mul_(1 - lr * weight_decay)
    avg, avg_sq = exp_avg.float(), exp_avg_sq.float()  # copies if bf16: stored below
    avg.add_((grad - avg).mul_(1 - beta1))
    avg_sq.mul_(beta2).add_(grad.mul(1 - beta2).mul_(grad))
    denom = avg_sq.double().sqrt_().float().div_((1 - beta2**step) ** 0.5).add_(eps)
    master.sub_(avg.div(denom).mul_(lr / (1 - beta1**step)))
    param.copy_(master)
    if exp_avg.dtype == torch.bfloat16:
        bits = stochastic_round.noise(seed, grad.numel(), grad.device).view(grad.shape)
        exp_avg.copy_(stochastic_round.round_stochastic(avg, bits & 0xFFFF))
        exp_avg_sq.copy_(stochastic_round.round_stochastic(avg_sq, bits >> 16))


def _shard_coordinates(param: torch.Tensor) -> list[int]:
    """This rank's coordinates on the mesh dimensions `param` is sharded over (none if not a DTensor)."""
    if not isinstance(param, DTensor):
        return []
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:  # this rank holds no shard
        return []
    return [c for c, placement in zip(coordinate, param.placements, strict=True) if placement.is_shard()]


def _update_fn(device: torch.device) -> Callable[..., None]:
    if device.type == "cuda":
        from tandem.trainer.adamw_kernel import adamw_

        return adamw_
    return adamw_torch_


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over fp32 masters of `params` (see the module docstring); param groups as torch's AdamW."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        moments_dtype: torch.dtype = torch.float32,
        units: list[list[nn.Parameter]] | None = None,
    ) -> None:
        """`units` (CUDA): step on a stream of its own, unit by unit in this order (trainer/step_stream.py);
        they must hold every parameter of `params` once."""
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"moments_dtype must be torch.float32 or torch.bfloat16, got {moments_dtype}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.grads: dict[nn.Parameter, torch.Tensor] = {}  # this rank's shards, bf16 or fp32
        self._scale: torch.Tensor | None = None
        self._noise_keys: dict[nn.Parameter, int] = {}  # per shard: its bf16 moments' rounding noise
        self._groups = {param: group for group in self.param_groups for param in group["params"]}
        for index, param in enumerate(self._params()):
            if not param.is_contiguous():
                raise ValueError(
                    f"MasterAdamW needs contiguous parameter shards, got strides {param.stride()}"
                )
            self.state[param] = {
                "step": torch.tensor(0.0),
                "master": param.detach().to(torch.float32, copy=True),
                "exp_avg": torch.zeros_like(param, dtype=moments_dtype),
                "exp_avg_sq": torch.zeros_like(param, dtype=moments_dtype),
            }
            self._noise_keys[param] = stochastic_round.noise_key(index, _shard_coordinates(param))
            previous = getattr(param, "_master_weights_hook", None)
            if previous is not None:  # an earlier MasterAdamW over the same parameters: this one takes over
                previous.remove()
            param._master_weights_hook = param.register_post_accumulate_grad_hook(self._take_grad)
        self._units = units or []
        self.step_stream: StepStream | None = None
        if units is not None:
            in_units = [p for unit in units for p in unit]
            if len(in_units) != len(set(in_units)) or set(in_units) != set(self._params()):
                raise ValueError("MasterAdamW's units must hold every parameter it updates exactly once")
            self.step_stream = StepStream(in_units[0].device)

    def _params(self) -> Iterable[nn.Parameter]:
        return chain.from_iterable(group["params"] for group in self.param_groups)

    def _take_grad(self, param: nn.Parameter) -> None:
        """Move the gradient just reduced onto `param` into the fp32 sum of this step's micro-batches."""
        grad, param.grad = local(param.grad), None
        held = self.grads.get(param)
        if held is None:
            self.grads[param] = grad
        elif held.dtype != torch.float32:
            self.grads[param] = held.float().add_(grad)
        else:
            held.add_(grad)

    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """The gradient of `param` accumulated this step (unscaled), sharded like it; None if none."""
        grad = self.grads.get(param)
        return None if grad is None else like(param, grad)

    def master(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 master of `param`, sharded like it (after the last step: `settle`)."""
        self.settle()
        return self.state[param]["master"]

    def scale_grads(self, scale: torch.Tensor) -> None:
        """Have the next step multiply every gradient by `scale` (0-dim; clipping's coefficient)."""
        self._scale = scale.to(torch.float32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.clear()
        self._scale = None

    def settle(self) -> None:
        """Make the current stream wait for the last step where it runs on a stream of its own."""
        if self.step_stream is not None:
            self.step_stream.settle()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        stream = self.step_stream
        if stream is None:
            for param in self._params():
                self._update(param)
            return loss
        stream.begin()
        for tensor in (*self.grads.values(), *([] if self._scale is None else [self._scale])):
            stream.keep(tensor)
        with torch.cuda.stream(stream.stream):
            for unit in self._units:
                for param in unit:
                    self._update(param)
                stream.unit_done()
        return loss

    def _update(self, param: nn.Parameter) -> None:
        grad = self.grads.get(param)
        if grad is None:
            return
        state = self.state[param]
        state["step"] += 1
        if not grad.numel():  # an empty shard (uneven sharding)
            return
        if self._scale is None or self._scale.device != grad.device:
            self._scale = torch.ones((), device=grad.device)
        group = self._groups[param]
        beta1, beta2 = group["betas"]
        step = int(state["step"].item())
        _update_fn(grad.device)(
            local(param), grad, local(state["master"]), local(state["exp_avg"]),
            local(state["exp_avg_sq"]), self._scale, float(group["lr"]), beta1, beta2,
            group["eps"], group["weight_decay"], step,
            stochastic_round.noise_seed(step, self._noise_keys[param]),
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy the saved state into this optimizer's tensors (torch's would cast them to the
        parameters' bf16) and write every parameter from its master. The moments keep this
        optimizer's dtype whatever the saved one: fp32 moments load into bf16 rounded to nearest
        (once; the steps after round stochastically), bf16 ones into fp32 exactly. (A resume
        through DCP, trainer/checkpoint.py, reads into these tensors in place, converting alike.)"""
        self.settle()
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups than this optimizer")
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for saved_id, param in zip(saved["params"], group["params"], strict=True):
                state = self.state[param]
                for key, value in state_dict["state"][saved_id].items():
                    if value is not state[key]:
                        state[key].copy_(value)
                local(param).copy_(local(state["master"]))
