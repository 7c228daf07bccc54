"""One Triton pass of AdamW over an fp32 master shard that also writes the model's parameter.

Per element it reads the gradient (bf16 or fp32), the fp32 master weight and the two fp32
moments, and writes the master, the moments and the parameter in its own dtype: 14 bytes read
and 14 written per element with a bf16 gradient and parameter (16 and 14 with an fp32 gradient),
the least any AdamW with fp32 state and a separate low-precision parameter can move. The
arithmetic is torch's AdamW (torch.optim.adamw, single-tensor form) in fp32; the gradient is
first multiplied by `scale`, a 0-dim fp32 tensor on the device (the clipping coefficient, read
in the kernel so that clipping costs no pass of its own and no host synchronisation). Tested on
CPU under TRITON_INTERPRET=1 against the torch form in trainer/master_weights.py.
"""

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, scale_ptr, numel,
    lr, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < numel
    grad = tl.load(grad_ptr + offsets, mask=valid).to(tl.float32) * tl.load(scale_ptr)
    weight = tl.load(master_ptr + offsets, mask=valid)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=valid)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=valid)
    weight = weight * (1.0 - lr * decay)
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)  # torch's lerp (weight < 0.5)
    exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    weight = weight - step_size * (exp_avg / denom)
    tl.store(master_ptr + offsets, weight, mask=valid)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=valid)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=valid)
    tl.store(param_ptr + offsets, weight.to(param_ptr.dtype.element_ty), mask=valid)


def adamw_(
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
) -> None:
    """One AdamW step in place on contiguous tensors of equal numel (see the module docstring)."""
    numel = master.numel()
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    _adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        param, grad, master, exp_avg, exp_avg_sq, scale, numel,
        lr, beta1, beta2, eps, weight_decay, lr / (1 - beta1**step), bias_correction2_sqrt,
        BLOCK=BLOCK,
    )  # fmt: skip
