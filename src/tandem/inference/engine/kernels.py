"""Fused Triton kernels for the CUDA forward pass (the CPU path uses plain torch ops).

A decode step of a small model is dominated by the number of kernels, not by their work, so
the elementwise chains of one layer are fused: residual add + RMSNorm, per-head q/k RMSNorm +
rotary embedding + KV-cache write, and SiLU-gate × up. Each kernel rounds to the activation
dtype where the reference implementation does, so bfloat16 results track transformers and
float32 results match it to rounding. Tested on CPU under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round a float32 value to the activation dtype and back (what an op in that dtype does)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = _round(x + tl.load(residual_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(residual_out_ptr + row * N + cols, x.to(dtype), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (_round(x * rstd, dtype) * w).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, residual_out, eps,
        N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
    )  # fmt: skip
    return out, residual_out


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr,
    cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, eps,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    row_width: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    dtype = q_ptr.dtype.element_ty
    d = tl.arange(0, half)
    src = qkv_ptr + token * row_width + head * HEAD_DIM
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + half + d).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
    is_q = head < HEADS
    w1 = tl.where(is_q, tl.load(q_weight_ptr + d), tl.load(k_weight_ptr + d)).to(tl.float32)
    w2 = tl.where(is_q, tl.load(q_weight_ptr + half + d), tl.load(k_weight_ptr + half + d)).to(tl.float32)
    n1 = _round(_round(x1 * rstd, dtype) * w1, dtype)
    n2 = _round(_round(x2 * rstd, dtype) * w2, dtype)
    pos = tl.load(positions_ptr + token)
    c1 = _round(tl.load(cos_ptr + pos * HEAD_DIM + d), dtype)
    c2 = _round(tl.load(cos_ptr + pos * HEAD_DIM + half + d), dtype)
    s1 = _round(tl.load(sin_ptr + pos * HEAD_DIM + d), dtype)
    s2 = _round(tl.load(sin_ptr + pos * HEAD_DIM + half + d), dtype)
    o1 = (_round(n1 * c1, dtype) - _round(n2 * s1, dtype)).to(dtype)
    o2 = (_round(n2 * c2, dtype) + _round(n1 * s2, dtype)).to(dtype)
    if is_q:
        dst = q_ptr + (token * HEADS + head) * HEAD_DIM
        tl.store(dst + d, o1)
        tl.store(dst + half + d, o2)
    else:
        kv_head = head - HEADS
        slot = tl.load(slots_ptr + token).to(tl.int64)
        out = (token * KV_HEADS + kv_head) * HEAD_DIM
        cache = (slot * KV_HEADS + kv_head) * HEAD_DIM
        tl.store(k_ptr + out + d, o1)
        tl.store(k_ptr + out + half + d, o2)
        tl.store(k_cache_ptr + cache + d, o1)
        tl.store(k_cache_ptr + cache + half + d, o2)
        full = tl.arange(0, HEAD_DIM)
        v = tl.load(qkv_ptr + token * row_width + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + full)
        tl.store(v_ptr + out + full, v)
        tl.store(v_cache_ptr + cache + full, v)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the fused q|k|v projection: normed and rotated q, k, and v, with k and v also
    written to their cache slots. Returns q [T, heads, d], k and v [T, kv_heads, d]."""
    tokens = qkv.shape[0]
    q = qkv.new_empty(tokens, heads, head_dim)
    k = qkv.new_empty(tokens, kv_heads, head_dim)
    v = qkv.new_empty(tokens, kv_heads, head_dim)
    _qk_norm_rope_kernel[(tokens, heads + kv_heads)](
        qkv, q, k, v, k_cache, v_cache, slots, positions, cos_table, sin_table, q_weight, k_weight, eps,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
    )  # fmt: skip
    return q, k, v


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * N + cols, (act * up).to(dtype), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :N]) * x[:, N:] for the fused gate|up projection."""
    rows, width = x.shape
    n = width // 2
    out = x.new_empty(rows, n)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, N=n, BLOCK=block)
    return out
