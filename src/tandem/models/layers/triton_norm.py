"""The Triton kernels of layers/norm.py (CUDA; tested on CPU under TRITON_INTERPRET=1).

A forward program takes one row whole (D up to 65,536 columns). A backward program takes a block
of consecutive rows, so the weight's gradient is summed in registers over the block and written
once per program as an fp32 partial sum; the partials are added after (a [programs, D] sum).
"""

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 1024  # backward: programs (and fp32 partial sums of ∂weight) at most


@triton.jit
def _forward_kernel(
    x_ptr, delta_ptr, w_ptr, s_ptr, out_ptr, rstd_ptr, D, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    s = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0)
    if HAS_DELTA:  # the residual addition, rounded to the activations' dtype as torch's is
        delta = tl.load(delta_ptr + row * D + cols, mask=inside, other=0.0)
        s = (s.to(tl.float32) + delta.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * D + cols, s, mask=inside)
    wide = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(wide * wide, axis=0) / D + eps)
    tl.store(rstd_ptr + row, rstd)
    normed = (wide * rstd).to(s_ptr.dtype.element_ty).to(tl.float32)  # cast back, then scale
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward_kernel(
    grad_out_ptr, grad_s_ptr, s_ptr, w_ptr, rstd_ptr, grad_x_ptr, partial_ptr, R, D, ROWS,
    HAS_GRAD_S: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    grad_w = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = program.to(tl.int64) * ROWS + i
        mask = inside & (row < R)
        grad = tl.load(grad_out_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < R, other=0.0)
        grad_w += grad * (s * rstd).to(s_ptr.dtype.element_ty).to(tl.float32)  # the forward's normed s
        grad_normed = grad * w
        # ∂s = rstd·g − rstd³/D · s · Σ g·s, for out = w · (s · rstd(s))
        grad_x = rstd * grad_normed - (rstd * rstd * rstd / D) * s * tl.sum(grad_normed * s, axis=0)
        if HAS_GRAD_S:  # the gradient that reaches s by the residual path
            grad_x += tl.load(grad_s_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + row * D + cols, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + program * D + cols, grad_w, mask=inside)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def forward(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, out, rstd) for contiguous x [..., D]: s = x + δ (x itself without δ), out = rms_norm(s)
    in the dtype torch's `weight * normed` gives, rstd [rows] fp32."""
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    has_delta = delta is not None
    s = torch.empty_like(x) if has_delta else x
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(dim)
        delta = delta.contiguous() if has_delta else x
        _forward_kernel[(rows,)](
            x,
            delta,
            weight,
            s,
            out,
            rstd,
            dim,
            eps,
            HAS_DELTA=has_delta,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return s, out, rstd


def backward(
    grad_out: torch.Tensor,
    grad_s: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂x, ∂weight): ∂x in s's dtype (∂δ is the same), ∂weight in the weight's."""
    dim = s.shape[-1]
    rows = rstd.numel()
    has_grad_s = grad_s is not None
    grad_x = torch.empty_like(s)
    programs = max(1, min(rows, MAX_PROGRAMS))
    per_program = triton.cdiv(rows, programs) if rows else 0
    partial = torch.zeros(programs, dim, dtype=torch.float32, device=s.device)
    if rows:
        block = triton.next_power_of_2(dim)
        grad_out = grad_out.contiguous()
        grad_s = grad_s.contiguous() if has_grad_s else grad_out
        _backward_kernel[(programs,)](
            grad_out, grad_s, s, weight, rstd, grad_x, partial, rows, dim, per_program,
            HAS_GRAD_S=has_grad_s, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return grad_x, partial.sum(0).to(weight.dtype)
