"""Triton kernels for FP8 weights (fp8.py): a matmul that reads e4m3 weights with their 128×128
block scales as they are, and the activation quantizers the `torch._scaled_mm` paths need.

`fp8_matmul` computes x·Wᵀ for bf16 activations as (W·xᵀ)ᵀ ("swap AB"): the weight's rows are the
MMA's M dimension (BLOCK_N: 64 or 128) and the activations' rows its N (BLOCK_M: 16 to 128), for a
decode step has few rows and Hopper's wgmma takes N down to 8 but M only from 64. Per K step of
128 (one scale block) a program loads a [BLOCK_N, 128] e4m3 tile and widens it to bf16 (exact:
every e4m3 value is a bf16 value) with integer instructions (`E4M3X2_TO_BF16X2`: the conversion
instructions, 16 a cycle per SM, held the kernel to about 2.4 TB/s on an H200). The widened tile
is the dot's first operand, which wgmma reads from registers: it never goes back to shared memory,
as it must as the second. The activations' tile [BLOCK_M, 128] is the second operand, transposed,
read from L2: 2·BLOCK_M/BLOCK_N bytes per weight byte, at most 2 up to 64 rows (4 with the
activations first and 32-row weight tiles). The product is multiplied in fp32 by the tile's block
scale (one number: BLOCK_N divides 128), accumulated in [BLOCK_N, BLOCK_M] and stored transposed.
A decode step is bound by reading the weights, which this halves against bf16; so every weight
byte is read once, and a layer with few output tiles (N = 4096 gives 64 tiles of 64 rows) splits K
over SPLIT_K programs whose partial sums meet in an fp32 buffer by atomic addition, so that enough
programs stream the weight at once. Larger batches (M > BLOCK_M) take the row blocks of one weight
tile in consecutive programs, so the tile is read from memory once and from L2 after. The
configuration (BLOCK_M beyond 64 rows, BLOCK_N, SPLIT_K, stages; warps follow) is timed per (rows
bucket, N, K) at the first call of that shape (a decode graph's warm-up run, outside the capture)
as a decode step runs it: cold weights, in a CUDA graph, the split's zeroing and cast included.
Measured so on an H200 (Qwen3-8B's qkv, o, gate_up and down in all, µs, against bf16's F.linear):
77 vs 108 at 16 rows, 113 vs 112 at 64, 217 vs 117 at 100, 231 vs 155 at 256; gate_up alone 32 vs
51 at 16 rows. Beyond 64 rows the matmul is no longer bound by the weight's reads alone, and
bf16's is faster.
`quantize_groups` (1×128 groups, for the blockwise recipe) and `quantize_rows` (one scale per
row, for the row-wise recipe) write e4m3 activations and float32 scales in one launch each.
Tested on CPU under TRITON_INTERPRET=1 (the widening there is Triton's cast: inline assembly
does not run in the interpreter); compiled for SM90 on CPU too.
"""

import functools
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

BLOCK = 128
E4M3_MAX = 448.0
MAX_BLOCK_M = 64
# (BLOCK_N, SPLIT_K, num_stages), each with BLOCK_M of up to 64 and of up to 128 rows; num_warps
# follows (`_warps`). Decode is bound by reading the weight, so the candidates differ in how many
# programs stream it at once and how many tiles each keeps in flight (on an H200 three stages won
# at every shape of a Qwen3-8B's layers, 1 to 256 rows)
CONFIGS = [
    (64, 1, 3), (64, 2, 3), (64, 4, 3), (64, 8, 3), (128, 1, 3), (128, 2, 3), (128, 4, 3), (128, 8, 3),
    (64, 1, 4), (64, 4, 4), (64, 8, 4), (128, 4, 4),
]  # fmt: skip
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETER_CONFIG = (64, 2, 1)  # the interpreter cannot time: one config, split (to test it)
# two e4m3 (the low bytes of $1) → two bf16 ($0): each byte to the top of a 16-bit half, its
# exponent and mantissa bits shifted to bf16's places under the sign, then × 2^120 (the exponent
# biases' difference; e4m3's subnormals become bf16 subnormals, which the multiply takes exactly)
E4M3X2_TO_BF16X2 = tl.constexpr("""{
.reg .b32 a, b, s, z;
mov.b32 s, 0x7B807B80;
mov.b32 z, 0x80008000;
prmt.b32 a, $1, 0, 0x1404;
shr.b32 b, a, 4;
and.b32 b, b, 0x07F007F0;
and.b32 a, a, 0x80008000;
or.b32 b, b, a;
fma.rn.bf16x2 $0, b, s, z;
}""")


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every batch size of a bucket
def _fp8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, xs_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_s, stride_xs, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    WIDEN_ASM: tl.constexpr, X_FP8: tl.constexpr,
):  # fmt: skip
    # outᵀ = W·xᵀ: the row blocks of one weight tile are neighbours in launch order (L2 reuse)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    # rows past M are masked, reading nothing (clamped to row M - 1, every program re-read that
    # row's cache lines: on an H200 1 row took up to 1.6× as long as 16)
    row_ok = rows < M
    xs = x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :]
    ws = w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :]
    # the weight's scale blocks are 128 × 128, BLOCK_K is 128 and BLOCK_N divides 128: the
    # tile at K step `step` has the one scale (cols[0] // 128, step)
    scales = s_ptr + (tl.program_id(1) * BLOCK_N // BLOCK_K) * stride_s
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = tl.program_id(2) * per_split
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(first, tl.minimum(first + per_split, steps)):
        x = tl.load(xs + step * BLOCK_K, mask=row_ok[:, None], other=0.0)
        w = tl.load(ws + step * BLOCK_K)
        if X_FP8:  # e4m3 × e4m3 on the tensor cores; the activations' scale per row and K step
            x_scale = tl.load(xs_ptr + step * stride_xs + rows, mask=row_ok, other=0.0)
            acc += tl.dot(w, tl.trans(x)) * (tl.load(scales + step) * x_scale[None, :])
        else:
            if WIDEN_ASM:  # integer ops: the conversion instructions (cvt) would bound the kernel
                w = tl.inline_asm_elementwise(
                    E4M3X2_TO_BF16X2,
                    "=r,r",
                    [w.to(tl.uint8, bitcast=True)],
                    dtype=tl.bfloat16,
                    is_pure=True,
                    pack=2,
                )
            # the widened weight is the dot's first operand: wgmma reads it from registers
            acc += tl.dot(w.to(x.dtype), tl.trans(x)) * tl.load(scales + step)
    out = out_ptr + rows[None, :].to(tl.int64) * stride_out + cols[:, None]
    mask = row_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # out is the zeroed float32 buffer the splits add into
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


def _warps(block_m: int, block_n: int) -> int:
    """Two warp groups where one would hold a 128 × 128 fp32 accumulator twice (sum and product)."""
    return 8 if block_n == 128 and block_m >= 128 else 4


def _run(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    config: tuple,
    x_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x_scales` ([M, K/128] column-major, as quantize_groups writes them) for e4m3 activations."""
    block_m, block_n, split, warps, stages = config
    m, k = x.shape
    n = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    out = (
        torch.empty(m, n, dtype=out_dtype, device=x.device)
        if split == 1
        else x.new_zeros(m, n, dtype=torch.float32)
    )
    x_fp8 = x_scales is not None
    xs = x_scales if x_fp8 else scale_inv  # (unread without e4m3 activations)
    grid = (triton.cdiv(m, block_m), n // block_n, split)
    _fp8_matmul_kernel[grid](
        x, weight, scale_inv, xs, out, m, n, k, x.stride(0), weight.stride(0), scale_inv.stride(0),
        xs.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, SPLIT_K=split,
        WIDEN_ASM=not INTERPRETED, X_FP8=x_fp8, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out if split == 1 else out.to(out_dtype)


def _candidates(rows_bucket: int, k: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) to time: BLOCK_M holds all rows up to
    64; beyond, blocks of 64 or 128 rows."""
    block_ms = sorted({min(rows_bucket, MAX_BLOCK_M), min(rows_bucket, 2 * MAX_BLOCK_M)})
    return [
        (bm, bn, split, _warps(bm, bn), stages)
        for bm in block_ms
        for bn, split, stages in CONFIGS
        if split <= k // BLOCK
    ]


def _cold_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], repeats: int = 5) -> float:
    """µs per call of `fn` as a decode step runs it: one call per weight copy (more bytes in all
    than L2, so every call reads its weight from memory), captured in a CUDA graph and replayed
    (no launch overhead, as in the engine's decode graphs)."""
    for w in weights:  # compiles, outside the capture
        fn(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # others may use the GPU
        for w in weights:
            fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeats * len(weights))


@functools.cache
def _tuned(rows_bucket: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """The fastest config for this shape and activation dtype (e4m3: the W8A8 kernel), timed as
    a decode step runs it (`_cold_us`; Triton's do_bench, which flushes L2 between launches,
    ranked them otherwise on an H200 and picked configs up to 1.4× slower). A config that needs
    more shared memory than the GPU has is left out."""
    x = torch.randn(rows_bucket, k, device=device)
    x_scales = None
    if dtype == torch.float8_e4m3fn:
        x, x_scales = quantize_groups(x, rows_bucket)
    else:
        x = x.to(dtype)
    # copies of twice L2 in all (at most 64: a layer too small for that is not bound by its reads),
    # random e4m3 bit patterns below 0x70 (no NaNs): timing does not depend on the values
    copies = min(64, max(2, -(-2 * torch.cuda.get_device_properties(device).L2_cache_size // (n * k))))
    weights = list(
        torch.randint(0, 0x70, (copies, n, k), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    )
    s = torch.rand(n // BLOCK, k // BLOCK, device=device)
    times = {}
    for c in _candidates(rows_bucket, k):
        try:
            times[c] = _cold_us(lambda w, c=c: _run(x, w, s, c, x_scales, torch.bfloat16), weights)
        except OutOfResources:
            continue
    if not times:
        raise RuntimeError(f"no fp8_matmul config fits this GPU for [{rows_bucket}, {k}] x [{n}, {k}]")
    return min(times, key=times.get)


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, x_scales: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] · weight [N, K] (e4m3, dequantized = weight × its block's `scale_inv` [N/128,
    ≥ K/128]) ᵀ → [M, N]. x is bf16 or fp32 (the result in its dtype), or e4m3 with `x_scales`
    ([M, K/128], per row and 128 channels, from quantize_groups; the result in bf16: W8A8, the
    tensor cores' FP8 product). N and K must be multiples of 128."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    out_dtype = torch.bfloat16 if x_scales is not None else x.dtype
    if INTERPRETED:
        block_m, (block_n, split, stages) = min(_bucket(m), MAX_BLOCK_M), INTERPRETER_CONFIG
        config = (block_m, block_n, split, _warps(block_m, block_n), stages)
    else:
        config = config_for(m, n, k, x.dtype, x.device)
    return _run(x, weight, scale_inv, config, x_scales, out_dtype)


def config_for(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) of fp8_matmul for an [m, k] · [n, k]ᵀ
    with activations of `dtype`."""
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


# The columns quantize_rows reads at a time: a Qwen3-8B attention output (K = 4,096) in one piece,
# each of its two passes one load. Measured on an H100 (2026-12-07, a CUDA graph, inputs in L2):
# 1.88 µs at 64 rows and 2.27 at 256, against 2.89 and 3.16 in 1,024-column pieces (2,048: 2.21,
# 2.54); 8 or 16 warps were no faster. The same bits: the row's maximum does not depend on the order.
QUANTIZE_ROWS_BLOCK = 4096


def quantize_rows(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per token: e4m3 [rows, K] and float32 scales [rows, 1]; `rows` ≥ len(x) pads
    with zeros (scale 1). One launch, no memset: the kernel writes the padding too."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(QUANTIZE_ROWS_BLOCK, triton.next_power_of_2(k))
        _quantize_rows_kernel[(rows,)](x, q, scales, m, k, x.stride(0), q.stride(0), BLOCK_K=block)
    return q, scales


@triton.jit
def _scale_outer_kernel(out_ptr, a_ptr, b_ptr, N, stride_out, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    y = tl.load(out_ptr + row * stride_out + cols, mask=ok).to(tl.float32)
    y = y * tl.load(a_ptr + row) * tl.load(b_ptr + cols, mask=ok)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def scale_outer_(out: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor) -> torch.Tensor:
    """out [M, N] *= row_scales [≥ M] (outer) col_scales [N], in place, in fp32, one launch."""
    m, n = out.shape
    if m:
        _scale_outer_kernel[(m, triton.cdiv(n, 1024))](
            out, row_scales, col_scales, n, out.stride(0), BLOCK_N=1024
        )
    return out
