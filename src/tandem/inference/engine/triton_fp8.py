"""Triton kernels for FP8 weights (fp8.py): a matmul that reads e4m3 weights with their 128×128
block scales as they are, and the activation quantizers the `torch._scaled_mm` paths need.

`fp8_matmul` computes x·Wᵀ for bf16 activations: each program loads a [BLOCK_N, 128] tile of
the e4m3 weight, widens it to bf16 (exact: every e4m3 value is a bf16 value), takes the dot
with the activations in fp32 and multiplies by the tile's block scale before accumulating. A
decode step is bound by reading the weights, which this halves against bf16.
`quantize_groups` (1×128 groups, for the blockwise recipe) and `quantize_rows` (one scale per
row, for the row-wise recipe) write e4m3 activations and float32 scales in one launch each.
Tested on CPU under TRITON_INTERPRET=1.
"""

import os

import torch
import triton
import triton.language as tl

BLOCK = 128
E4M3_MAX = 448.0
CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
    for m, n, w, s in [
        (16, 32, 4, 4),
        (16, 64, 4, 4),
        (16, 64, 4, 6),
        (16, 128, 4, 4),
        (32, 64, 4, 4),
        (64, 32, 4, 4),
        (64, 64, 4, 3),
        (64, 128, 8, 3),
        (128, 128, 8, 3),
    ]  # decode is bound by reading the weight: small BLOCK_M, enough programs and stages in flight
]


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_s, stride_out, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + (k0 + k)[None, :], mask=row_ok[:, None], other=0.0
        )
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_w + (k0 + k)[None, :], mask=col_ok[:, None], other=0.0
        )
        # the weight's scale blocks are 128 × 128 and BLOCK_K is 128: block (col // 128, k0 // 128)
        scale = tl.load(s_ptr + (cols // BLOCK_K) * stride_s + k0 // BLOCK_K, mask=col_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype))) * scale[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# tuned once per (power-of-two bucket of M, N, K), at the first call of that shape (a decode
# graph's warm-up run, outside the capture); the interpreter cannot time, so it runs one config
_fp8_matmul_tuned = triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K"])(_fp8_matmul_kernel)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) · weight [N, K] (e4m3, dequantized = weight × its block's
    `scale_inv` [N/128, K/128]) ᵀ → [M, N] in x's dtype. K must be a multiple of 128."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    out = x.new_empty(m, n)
    args = (
        x,
        weight,
        scale_inv,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale_inv.stride(0),
        out.stride(0),
    )
    if INTERPRETED:
        grid = (triton.cdiv(m, 16), triton.cdiv(n, 32))
        _fp8_matmul_kernel[grid](*args, triton.next_power_of_2(m), BLOCK_M=16, BLOCK_N=32, BLOCK_K=BLOCK)
        return out
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _fp8_matmul_tuned[grid](*args, triton.next_power_of_2(m), BLOCK_K=BLOCK)
    return out


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, stride_x, stride_q, rows, GROUP: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    valid = row < M  # rows M… are padding: zeros with scale 1
    k = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + k, mask=valid, other=0.0).to(tl.float32)
    scale = tl.where(valid, tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0, 1.0)
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + k, q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + group * rows + row, scale)  # [rows, groups] stored column-major


def quantize_groups(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and 128 channels: e4m3 [rows, K] and float32 scales [rows, K/128] (column-major,
    as the blockwise `_scaled_mm` wants them), for x's first rows; `rows` ≥ len(x) pads with zeros
    (scale 1). One launch, no memset: the kernel writes the padding too."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k // BLOCK, rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_groups_kernel[(rows, k // BLOCK)](
            x, q, scales, m, x.stride(0), q.stride(0), rows, GROUP=BLOCK
        )
    return q, scales.t()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    valid = row < M  # rows M… are padding: zeros with scale 1
    amax = tl.zeros((), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + k, mask=(k < K) & valid, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    scale = tl.where(valid, tl.maximum(amax, 1e-12) / 448.0, 1.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + k, mask=(k < K) & valid, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per token: e4m3 [rows, K] and float32 scales [rows, 1]; `rows` ≥ len(x) pads
    with zeros (scale 1). One launch, no memset: the kernel writes the padding too."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scales, m, k, x.stride(0), q.stride(0), BLOCK_K=1024)
    return q, scales
