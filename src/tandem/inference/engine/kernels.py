"""Fused Triton kernels for the CUDA forward pass (the CPU path uses plain torch ops).

A decode step of a small model is dominated by the number of kernels, not by their work, so
the elementwise chains of one layer are fused: residual add + RMSNorm, per-head q/k RMSNorm +
rotary embedding + KV-cache write, and SiLU-gate × up. Each kernel rounds to the activation
dtype where the reference implementation does, so bfloat16 results track transformers and
float32 results match it to rounding. Tested on CPU under TRITON_INTERPRET=1.

With FP8 weights (fp8.py, the row-wise kernel) the same kernels also take the place of the
launches around each FP8 matmul: an input given as a product before its scales ("raw" with
per-row and per-column scales, fp8.Unscaled) is scaled as it is read, and RMSNorm and SiLU·mul
can write their output as e4m3 rows with one scale per row (fp8.Quantized) for the matmul that
reads it. Each rounds where the separate launches (triton_fp8.scale_outer_ and quantize_rows)
round, so fused and separate give the same bits.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round a float32 value to the activation dtype and back (what an op in that dtype does)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _scaled(x, row_scale_ptr, col_scale_ptr, row, cols, mask, dtype: tl.constexpr):
    """A product before its scales, scaled as scale_outer_ does (fp32, row then column) and rounded."""
    return _round(
        x * tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0), dtype
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, row_scale_ptr, col_scale_ptr,
    q_ptr, q_scale_ptr, M, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, X_SCALED: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    valid = row < M  # rows M… exist with QUANT only: the FP8 matmul's padding
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * N + cols, mask=mask & valid, other=0.0).to(tl.float32)
    if X_SCALED:  # (padding rows read row M - 1's scale: their x is zero)
        x = _scaled(x, row_scale_ptr, col_scale_ptr, tl.minimum(row, M - 1), cols, mask & valid, dtype)
    if HAS_RESIDUAL:
        x = _round(
            x + tl.load(residual_ptr + row * N + cols, mask=mask & valid, other=0.0).to(tl.float32), dtype
        )
        tl.store(residual_out_ptr + row * N + cols, x.to(dtype), mask=mask & valid)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(_round(x * rstd, dtype) * w, dtype)
    if QUANT:  # as triton_fp8.quantize_rows writes it; padding rows are zeros with scale 1
        scale = tl.where(valid, tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0, 1.0)
        q = tl.clamp(y / scale, -448.0, 448.0)
        tl.store(q_ptr + row * N + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * N + cols, y.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    x_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    quantized_rows: int | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x).

    `x_scales` (row scales [≥ rows], column scales [N]): x is a product before its scales
    (needs a residual: the scaled x is the new residual stream). `quantized_rows` (≥ rows): the
    norm is returned as (e4m3 [quantized_rows, N], float32 scales [quantized_rows, 1]) instead."""
    rows, n = x.shape
    if x_scales is not None and residual is None:
        raise ValueError("rms_norm: a scaled input needs a residual")
    residual_out = torch.empty_like(x) if residual is not None else x
    quant = quantized_rows is not None
    programs = quantized_rows if quant else rows
    if quant:
        out = torch.empty(programs, n, dtype=torch.float8_e4m3fn, device=x.device)
        out_scales = torch.empty(programs, 1, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty_like(x)
        out_scales = out
    row_scales, col_scales = x_scales if x_scales is not None else (x, x)
    _rms_norm_kernel[(programs,)](
        x, residual if residual is not None else x, weight, out, residual_out, row_scales, col_scales,
        out, out_scales, rows, eps,
        N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
        X_SCALED=x_scales is not None, QUANT=quant,
    )  # fmt: skip
    return ((out, out_scales) if quant else out), residual_out


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr,
    cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, row_scale_ptr, col_scale_ptr, eps,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr,
    X_SCALED: tl.constexpr,
):  # fmt: skip
    """One program per token: its q and k heads (padded to HEADS_P2) as [HEADS_P2, HEAD_DIM / 2]
    tiles, one per half of the head dim, sharing the position's cos/sin; v is copied beside k
    (X_SCALED: qkv is a product before its scales, applied as each part is read)."""
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
    if X_SCALED:
        x1 = _scaled(x1, row_scale_ptr, col_scale_ptr, token, h * HEAD_DIM + d, valid, dtype)
        x2 = _scaled(x2, row_scale_ptr, col_scale_ptr, token, h * HEAD_DIM + half + d, valid, dtype)
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
    if X_SCALED:
        v_cols = (h + KV_HEADS) * HEAD_DIM + d
        v1 = _scaled(v1.to(tl.float32), row_scale_ptr, col_scale_ptr, token, v_cols, is_k, dtype).to(dtype)
        v2 = _scaled(v2.to(tl.float32), row_scale_ptr, col_scale_ptr, token, v_cols + half, is_k, dtype).to(
            dtype
        )
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
    qkv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the fused q|k|v projection: normed and rotated q, k, and v, with k and v also
    written to their cache slots. Returns q [T, heads, d], k and v [T, kv_heads, d].
    `qkv_scales` (row scales [≥ T], column scales [width]): qkv is a product before them."""
    tokens = qkv.shape[0]
    q = qkv.new_empty(tokens, heads, head_dim)
    k = qkv.new_empty(tokens, kv_heads, head_dim)
    v = qkv.new_empty(tokens, kv_heads, head_dim)
    heads_p2 = triton.next_power_of_2(heads + kv_heads)
    row_scales, col_scales = qkv_scales if qkv_scales is not None else (qkv, qkv)
    _qk_norm_rope_kernel[(tokens,)](
        qkv, q, k, v, k_cache, v_cache, slots, positions, cos_table, sin_table, q_weight, k_weight,
        row_scales, col_scales, eps,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEADS_P2=heads_p2, X_SCALED=qkv_scales is not None,
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


@triton.jit
def _silu_mul_block(
    x_ptr, row_scale_ptr, col_scale_ptr, row, scale_row, cols, mask, N, dtype: tl.constexpr, X_SCALED: tl.constexpr
):  # fmt: skip
    """silu(gate) * up for one block of a row's columns, rounded as _silu_mul_kernel rounds."""
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    if X_SCALED:
        gate = _scaled(gate, row_scale_ptr, col_scale_ptr, scale_row, cols, mask, dtype)
        up = _scaled(up, row_scale_ptr, col_scale_ptr, scale_row, N + cols, mask, dtype)
    return _round(_round(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, row_scale_ptr, col_scale_ptr, q_ptr, q_scale_ptr, M, N, BLOCK: tl.constexpr, X_SCALED: tl.constexpr
):  # fmt: skip
    """One program per row, the whole row in registers: its amax, then the row as e4m3 (as
    triton_fp8.quantize_rows writes silu_mul's output; rows M… are the matmul's padding)."""
    row = tl.program_id(0).to(tl.int64)
    valid = row < M
    cols = tl.arange(0, BLOCK)
    mask = (cols < N) & valid
    scale_row = tl.minimum(row, M - 1)  # (padding rows read nothing but a scale)
    y = _silu_mul_block(
        x_ptr, row_scale_ptr, col_scale_ptr, row, scale_row, cols, mask, N, x_ptr.dtype.element_ty, X_SCALED
    )
    scale = tl.where(valid, tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0, 1.0)
    q = tl.clamp(y / scale, -448.0, 448.0)
    tl.store(q_ptr + row * N + cols, q.to(q_ptr.dtype.element_ty), mask=cols < N)
    tl.store(q_scale_ptr + row, scale)


def row_warps(block: int) -> int:
    """Warps for a program that holds a row of `block` values: 32 values a thread, 4 to 16 warps."""
    return min(16, max(4, block // 1024))


def silu_mul_quantized(
    x: torch.Tensor, quantized_rows: int, x_scales: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul(x) as e4m3 rows [quantized_rows (≥ rows), N] with float32 scales [quantized_rows,
    1], for an FP8 matmul; `x_scales` (row scales, column scales [2N]): x is a product before them."""
    rows, width = x.shape
    n = width // 2
    q = torch.empty(quantized_rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(quantized_rows, 1, dtype=torch.float32, device=x.device)
    row_scales, col_scales = x_scales if x_scales is not None else (x, x)
    block = triton.next_power_of_2(n)
    _silu_mul_quant_kernel[(quantized_rows,)](
        x, row_scales, col_scales, q, scales, rows, n,
        BLOCK=block, X_SCALED=x_scales is not None, num_warps=row_warps(block),
    )  # fmt: skip
    return q, scales
