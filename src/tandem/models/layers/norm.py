"""RMSNorm with transformers' order of rounding: normalise in fp32, cast back, then scale.

Scaling after the cast (not before) is what Qwen's reference does; keeping it bit-for-bit
makes the trainer's bf16 activations equal the engine's, which keeps the trainer–sampler
mismatch small.

With `FUSED_ON_CUDA` on CUDA (bf16, fp16 or fp32 inputs) the norm runs as one autograd function with one-pass Triton
kernels each way (layers/triton_norm.py), and `add_and_norm` also takes the residual addition
before it: the forward reads x and δ once and writes s = x + δ, the normed s and one fp32 rstd a
row; the backward reads ∂out, s and the gradient that reaches s by the residual path once, and
writes ∂s (which is ∂x and ∂δ) with the weight's gradient summed per block of rows. The
forward's bits are the reference's but for rsqrt's last place; the backward differs from
autograd's in rounding only: it stays in fp32 where autograd rounds ∂(normed s) to bf16 first.
Off (the default until measured on the device), CUDA runs the torch form too, as torch.compile
makes it (`trainer_mfu.py`'s `fusednorm` flag compares the two).
"""

import torch
from torch import nn

FUSED_ON_CUDA = False
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference form: normalise in fp32 (fp64 stays fp64), cast back, scale."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return FUSED_ON_CUDA and x.is_cuda and x.dtype in FUSED_DTYPES and weight.dtype in FUSED_DTYPES


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x, self.weight):
            return FusedAddRMSNorm.apply(x, None, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) for s = x + δ: a pre-norm block's residual addition and the next norm."""
        if _fused(x, self.weight) and delta.dtype == x.dtype:
            return FusedAddRMSNorm.apply(x, delta, self.weight, self.eps)
        s = x + delta
        return s, rms_norm(s, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FusedAddRMSNorm(torch.autograd.Function):
    """(x, δ, weight, eps) → (s = x + δ, rms_norm(s)); (x, None, weight, eps) → rms_norm(x). CUDA only."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from tandem.models.layers import triton_norm

        s, out, rstd = triton_norm.forward(x.contiguous(), delta, weight, eps)
        ctx.save_for_backward(s, weight, rstd)
        ctx.has_delta = delta is not None
        return (s, out) if ctx.has_delta else out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, None]:
        from tandem.models.layers import triton_norm

        s, weight, rstd = ctx.saved_tensors
        grad_s, grad_out = grads if ctx.has_delta else (None, grads[0])
        grad_x, grad_weight = triton_norm.backward(grad_out, grad_s, s, weight, rstd)
        return grad_x, grad_x if ctx.has_delta else None, grad_weight, None
