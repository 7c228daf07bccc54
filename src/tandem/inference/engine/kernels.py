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
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr,
):  # fmt: skip
    """One program per token: its q and k heads (padded to HEADS_P2) as [HEADS_P2, HEAD_DIM / 2]
    tiles, one per half of the head dim, sharing the position's cos/sin; v is copied beside k."""
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    row_width: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    dtype = q_ptr.dtype.element_ty
    h = tl.arange(0, HEADS_P2)[:, None]  # q heads, then k heads, then padding
    d = tl.arange(0, half)[None, :]
    is_q = h < HEADS
    is_k = (h >= HEADS) & (h < HEADS + KV_HEADS)
    valid = is_q | is_k
    src = qkv_ptr + token * row_width + h * HEAD_DIM + d
    x1 = tl.load(src, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=valid, other=0.0).to(tl.float32)
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # per head, in fp32
    rstd = (1.0 / tl.sqrt(squares / HEAD_DIM + eps))[:, None]
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
    q_dst = q_ptr + (token * HEADS + h) * HEAD_DIM + d
    tl.store(q_dst, o1, mask=is_q)
    tl.store(q_dst + half, o2, mask=is_q)
    # k rows: head h is kv head h - HEADS; its v sits KV_HEADS heads further along the qkv row
    slot = tl.load(slots_ptr + token).to(tl.int64)
    out = (token * KV_HEADS + h - HEADS) * HEAD_DIM + d
    cache = (slot * KV_HEADS + h - HEADS) * HEAD_DIM + d
    tl.store(k_ptr + out, o1, mask=is_k)
    tl.store(k_ptr + out + half, o2, mask=is_k)
    tl.store(k_cache_ptr + cache, o1, mask=is_k)
    tl.store(k_cache_ptr + cache + half, o2, mask=is_k)
    v1 = tl.load(src + KV_HEADS * HEAD_DIM, mask=is_k)
    v2 = tl.load(src + KV_HEADS * HEAD_DIM + half, mask=is_k)
    tl.store(v_ptr + out, v1, mask=is_k)
    tl.store(v_ptr + out + half, v2, mask=is_k)
    tl.store(v_cache_ptr + cache, v1, mask=is_k)
    tl.store(v_cache_ptr + cache + half, v2, mask=is_k)


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
    heads_p2 = triton.next_power_of_2(heads + kv_heads)
    _qk_norm_rope_kernel[(tokens,)](
        qkv, q, k, v, k_cache, v_cache, slots, positions, cos_table, sin_table, q_weight, k_weight, eps,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEADS_P2=heads_p2,
        num_warps=min(16, max(4, heads_p2 * head_dim // 1024)),
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
