"""Triton kernels for FP8 weights (fp8.py): a matmul that reads e4m3 weights with their 128×128
block scales as they are, and the activation quantizers the `torch._scaled_mm` paths need.

`fp8_matmul` computes x·Wᵀ for bf16 activations: each program holds all of a decode step's rows
(up to 64) and a [BLOCK_N, 128] tile of the e4m3 weight at a time, widens it to bf16 (exact:
every e4m3 value is a bf16 value), takes the dot with the activations in fp32 and multiplies by
the tile's block scale (one number: BLOCK_N divides 128) before accumulating. A decode step is
bound by reading the weights, which this halves against bf16; so every weight byte is read
once (all rows in one program), and a layer with few output tiles (N = 4096 gives 32 of 128)
splits K over SPLIT_K programs whose partial sums meet in an fp32 buffer by atomic addition,
so that enough programs stream the weight at once. The configuration (BLOCK_M beyond 64 rows,
BLOCK_N, SPLIT_K, warps, stages) is timed per (rows bucket, N, K) at the first call of that shape
(a decode graph's warm-up run, outside the capture), the split's extra zeroing and cast included.
Larger batches (M > 64) take the row blocks of one weight tile in consecutive programs, so the
tile is read from memory once and from L2 after.
`quantize_groups` (1×128 groups, for the blockwise recipe) and `quantize_rows` (one scale per
row, for the row-wise recipe) write e4m3 activations and float32 scales in one launch each.
Tested on CPU under TRITON_INTERPRET=1; compiled for SM90 on CPU too.
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

BLOCK = 128
E4M3_MAX = 448.0
MAX_BLOCK_M = 64
# (BLOCK_N, SPLIT_K, num_warps, num_stages): decode is bound by reading the weight, so the
# candidates differ in how many programs stream it at once and how many tiles each keeps in flight
CONFIGS = [
    (32, 1, 4, 4), (32, 2, 4, 4), (32, 4, 4, 4), (32, 8, 4, 4),
    (64, 1, 4, 4), (64, 2, 4, 4), (64, 4, 4, 4), (64, 8, 4, 3), (64, 1, 4, 6),
    (128, 1, 4, 4), (128, 2, 8, 4), (128, 4, 8, 4),
]  # fmt: skip
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETER_CONFIG = (32, 2, 4, 1)  # the interpreter cannot time: one config, split (to test it)


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_s, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    # the row blocks of one weight tile are neighbours in launch order: they read it from L2
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    # the weight's scale blocks are 128 × 128, BLOCK_K is 128 and BLOCK_N divides 128: the
    # tile at K step `step` has the one scale (cols[0] // 128, step)
    scales = s_ptr + (tl.program_id(1) * BLOCK_N // BLOCK_K) * stride_s
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = tl.program_id(2) * per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, tl.minimum(first + per_split, steps)):
        k0 = step * BLOCK_K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + (k0 + k)[None, :], mask=row_ok[:, None], other=0.0
        )
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_w + (k0 + k)[None, :], mask=col_ok[:, None], other=0.0
        )
        acc += tl.dot(x, tl.trans(w.to(x.dtype))) * tl.load(scales + step)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # out is the zeroed float32 buffer the splits add into
        tl.atomic_add(out, acc, mask=mask)


def _run(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, config: tuple) -> torch.Tensor:
    block_m, block_n, split, warps, stages = config
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(m, n) if split == 1 else torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), n // block_n, split)
    _fp8_matmul_kernel[grid](
        x, weight, scale_inv, out, m, n, k, x.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, SPLIT_K=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out if split == 1 else out.to(x.dtype)


@functools.cache
def _tuned(rows_bucket: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """The fastest config for this shape, timed on random data (L2 flushed between runs): BLOCK_M
    holds all rows up to 64; beyond, blocks of 64 or 128 rows. A config that needs more shared
    memory than the GPU has is left out (on an H200 at 256 rows one asked for 248 KiB of 227)."""
    x = torch.randn(rows_bucket, k, dtype=dtype, device=device)
    w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    s = torch.rand(n // BLOCK, k // BLOCK, device=device)
    block_ms = sorted({min(rows_bucket, MAX_BLOCK_M), min(rows_bucket, 2 * MAX_BLOCK_M)})
    candidates = [(bm, *c) for bm in block_ms for c in CONFIGS if c[1] <= k // BLOCK]
    times = {}
    for c in candidates:
        try:
            times[c] = triton.testing.do_bench(lambda c=c: _run(x, w, s, c), warmup=5, rep=20)
        except OutOfResources:
            continue
    if not times:
        raise RuntimeError(f"no fp8_matmul config fits this GPU for [{rows_bucket}, {k}] x [{n}, {k}]")
    return min(times, key=times.get)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) · weight [N, K] (e4m3, dequantized = weight × its block's
    `scale_inv` [N/128, ≥ K/128]) ᵀ → [M, N] in x's dtype. N and K must be multiples of 128."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    if INTERPRETED:
        return _run(x, weight, scale_inv, (min(_bucket(m), MAX_BLOCK_M), *INTERPRETER_CONFIG))
    return _run(x, weight, scale_inv, config_for(m, n, k, x.dtype, x.device))


def config_for(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) of fp8_matmul for an [m, k] · [n, k]ᵀ."""
    return _tuned(_bucket(m), n, k, dtype, device)


def _bucket(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


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
