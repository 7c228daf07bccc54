"""One-pass sampling on CUDA: temperature, exponential-race draw and the drawn token's logprob.

The torch sampler (sampler.py) makes ~12 passes over the `[rows, vocab]` logits (cast to
float32, log_softmax, exp, noise, divide, argmax, gather); this kernel reads the logits once,
in their own dtype, and draws what the torch path draws up to float rounding.

What it computes, per row with temperature T and logits x:
- the token: the lowest column c of the largest race score `x[c] / T - log(-log u[c])`, or of
  `x[c]` for a greedy row (T ≤ 0). `u[c]` is sampler.py's counter-based uniform, the same bits:
  `h = fmix32(fmix32(row_hash + c * 0x9E3779B9) ^ row_hash)`, `u = ((h >> 8) + 0.5) / 2**24`,
  `row_hash = fmix32(key ^ fmix32(position))`. A seeded row's key is its sample key; a row
  without one uses `fmix32(step_seed ^ fmix32(row + 0x2545F491))`, so unseeded noise costs
  nothing extra either. `x / T` is computed as `x * (1 / T)`: exactly x for T = 1;
- the logprob: log_softmax(x / T) at that token (T = 1 for a greedy row).

How: `_partial_kernel` runs `splits` programs per row (by default one warp each), each over a
chunk of whole BLOCKs of columns, one BLOCK per step. Each lane (the columns ≡ lane mod BLOCK)
keeps its own sum of exponentials and its best score with that score's column. A step reduces
one value across the lanes (with one warp: shuffles, no shared memory, no barrier): the largest
upper bound of its scores, `x + _noise_bound(u)` ≥ x, cheap from the hash's bits. It is the
softmax's reference, and it skips the costly part of the scores, the two logs of the noise, in
steps where no column can beat the best score so far: after a chunk's first steps, most. Only
the steps that take the logs reduce a second value, the new best. `_combine_kernel` merges a
row's chunks. Greedy rows skip the hash and the logs.

Invariants: skipping changes no token (a skipped column scores at most the best before it);
ties go to the lowest column as with a plain argmax (within a lane only a strictly higher score
replaces the best; across lanes and chunks the lowest column of the maximum wins); a row whose
scores are all -inf draws column 0; the drawn column is below `vocab`.

It covers rows without top-k, top-p, min-p and alternatives (`SamplingRows.fused`); other
batches take the torch path. Tested on CPU under TRITON_INTERPRET=1 (tests/inference/
test_engine_triton.py); timed on CUDA by benchmarks/sample_kernel.py. The launch parameters
below are module constants that fused_sample reads at each call (the benchmark sweeps them).
"""

import torch
import triton
import triton.language as tl

# (the fastest of benchmarks/sample_kernel.py --sweep on an H200, 2026-12-04: 74.6 µs for 256
# rows × 151,936 bf16 logits at T = 1, 169 µs for the kernel before; 28.0 µs for 64 rows, 46.3)
BLOCK = 512  # lanes: columns per step (a power of two)
NUM_WARPS = 1  # one warp: a step's max is warp shuffles, no shared memory, no barrier
PROGRAMS = 2048  # programs a launch aims at: splits per row = PROGRAMS / rows, capped
MAX_SPLITS = 64  # most programs per row (a power of two: the combining program's width)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
SLACK: tl.constexpr = tl.constexpr(1e-3)  # absolute rounding margin of the skip test
NO_COLUMN: tl.constexpr = tl.constexpr(2**31 - 1)  # above every column: loses every lowest-column merge


@triton.jit
def _fmix32(x):
    """MurmurHash3's finaliser on uint32 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _lowest_argmax(score, column):
    """The largest score and the lowest column holding it."""
    top = tl.max(score, axis=0)
    return top, tl.min(tl.where(score == top, column, NO_COLUMN), axis=0)


@triton.jit
def _noise_bound(u):
    """An upper bound of the noise -log(-log u) without a log, from the float bits of 1 - u.

    -log u ≥ 1 - u = v, so -log(-log u) ≤ -log v; and for v = 2**e * (1 + f), f in [0, 1),
    log2 v ≥ e + f = bits(v) / 2**23 - 127, so -log v ≤ (127 - bits(v) / 2**23) * ln 2. Over the
    noise by less than 0.06 + log(-log u / v), whose second term vanishes as u nears 1, where the
    noise is large.
    """
    bits = (1.0 - u).to(tl.int32, bitcast=True).to(tl.float32)
    return bits * (-LN2 / 8388608.0) + 127.0 * LN2


@triton.jit
def _scan_chunk(row_ptr, start, chunk, vocab, inv_t, row_hash, BLOCK: tl.constexpr, NOISE: tl.constexpr):
    """Columns [start, start + chunk) of a row: (ref, per-lane sums of exp(x - ref)), the per-lane
    best score and its column.

    Each step reduces one value across the lanes, `reach`: the largest x (greedy), or of the
    score bounds `x + _noise_bound(u)` (noise; ≥ x up to rounding). The softmax reference `ref` is
    the largest reach so far: no x exceeds it (no overflow), the largest is within 18 of it.

    With NOISE a step takes the logs only when its reach clears `bar`: the best score so far
    (`tl.max(best)`), less a margin for the rounding of x, of the logs and of the bound (wherever
    a column could score above that best, |x| ≤ |best| + 18). A skipped column scores at most that
    best and comes after it, so it is never drawn; lanes may hold stale bests, never one above the
    chunk's: the chunk's best score and its column are exact.
    """
    lanes = start + tl.arange(0, BLOCK)
    ref = tl.full((), -1e30, tl.float32)  # finite: ref - max(ref, reach) is a number
    total = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    column = lanes  # a lane whose scores are all -inf reports its first column
    bar = tl.full((), float("-inf"), tl.float32)
    for offset in range(0, chunk, BLOCK):
        cols = lanes + offset
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if NOISE:
            x = x * inv_t
            h = row_hash + cols.to(tl.uint32) * 0x9E3779B9
            h = _fmix32(_fmix32(h) ^ row_hash)
            u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0) + 0.5 / 16777216.0  # ((h >> 8) + 0.5) / 2**24
            reach = tl.max(x + _noise_bound(u), axis=0)
        else:
            reach = tl.max(x, axis=0)
        new_ref = tl.maximum(ref, reach)
        total = total * tl.exp2((ref - new_ref) * LOG2E) + tl.exp2((x - new_ref) * LOG2E)
        ref = new_ref
        if NOISE:
            if reach > bar:
                score = x - tl.log(-tl.log(u))
                better = score > best  # masked columns score -inf: never better
                column = tl.where(better, cols, column)
                best = tl.where(better, score, best)
                top = tl.max(best, axis=0)
                bar = top - tl.abs(top) * (1.0 / 1048576.0) - SLACK  # -inf while every score is
        else:
            better = x > best
            column = tl.where(better, cols, column)
            best = tl.where(better, x, best)
    return ref, total, best, column


@triton.jit(do_not_specialize=["step_seed"])
def _partial_kernel(
    logits_ptr, stride, temps_ptr, keys_ptr, positions_ptr, step_seed, vocab, chunk,
    ref_ptr, sum_ptr, best_ptr, index_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    inv_t = tl.div_rn(1.0, tl.where(temp > 0.0, temp, 1.0))
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    start = split * chunk
    if temp > 0.0:
        key = tl.load(keys_ptr + row)
        unseeded_key = _fmix32(step_seed.to(tl.uint32) ^ _fmix32((row + 0x2545F491).to(tl.uint32)))
        key32 = tl.where(key >= 0, key.to(tl.uint32), unseeded_key)
        row_hash = _fmix32(key32 ^ _fmix32(tl.load(positions_ptr + row).to(tl.uint32)))
        ref, total, best, column = _scan_chunk(row_ptr, start, chunk, vocab, inv_t, row_hash, BLOCK, True)
    else:
        ref, total, best, column = _scan_chunk(row_ptr, start, chunk, vocab, inv_t, 0, BLOCK, False)
    best_all, column_all = _lowest_argmax(best, column)
    out = row * tl.num_programs(1) + split
    tl.store(ref_ptr + out, ref)
    tl.store(sum_ptr + out, tl.sum(total, axis=0))
    tl.store(best_ptr + out, best_all)
    tl.store(index_ptr + out, column_all)


@triton.jit(do_not_specialize=["rows", "splits"])  # one compile for every batch (none mid-run)
def _combine_kernel(
    logits_ptr, stride, temps_ptr, ref_ptr, sum_ptr, best_ptr, index_ptr, tokens_ptr, result_ptr, rows,
    splits, SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    lane = tl.arange(0, SPLITS)
    valid = lane < splits
    parts = row * splits + lane
    ref = tl.load(ref_ptr + parts, mask=valid, other=float("-inf"))
    total = tl.load(sum_ptr + parts, mask=valid, other=0.0)
    best = tl.load(best_ptr + parts, mask=valid, other=float("-inf"))
    index = tl.load(index_ptr + parts, mask=valid, other=NO_COLUMN)
    ref_all = tl.max(ref, axis=0)
    lse = ref_all + tl.log(tl.sum(total * tl.exp(ref - ref_all), axis=0))
    token = _lowest_argmax(best, index)[1]
    temp = tl.load(temps_ptr + row)
    inv_t = tl.div_rn(1.0, tl.where(temp > 0.0, temp, 1.0))
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(result_ptr + row, token.to(tl.float64))
    tl.store(result_ptr + rows + row, (x - lse).to(tl.float64))


def fused_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    step_seed: int,
    tokens_out: torch.Tensor,
) -> torch.Tensor:
    """Draw one token per row of `logits` ([rows, vocab], any float dtype, unit column stride).

    temperatures: [rows] float32 (≤ 0: greedy); keys: [rows] int64, a seeded row's sample key or
    -1; positions: [rows] int64, the position of the token each row draws; step_seed: a 31-bit
    seed for the unseeded rows of this step. Writes the ids to `tokens_out` ([rows] int64) and
    returns [2, rows] float64: the ids and their logprobs (log_softmax(logits / T), T = 1 if greedy).
    """
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    blocks = triton.cdiv(vocab, BLOCK)
    splits = min(blocks, MAX_SPLITS, triton.cdiv(PROGRAMS, rows))
    chunk = BLOCK * triton.cdiv(blocks, splits)
    splits = triton.cdiv(vocab, chunk)  # every program has columns
    partial = torch.empty(3, rows * splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
    result = torch.empty(2, rows, dtype=torch.float64, device=logits.device)
    _partial_kernel[(rows, splits)](
        logits, logits.stride(0), temperatures, keys, positions, step_seed & 0x7FFFFFFF, vocab, chunk,
        partial[0], partial[1], partial[2], index,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    _combine_kernel[(rows,)](
        logits, logits.stride(0), temperatures, partial[0], partial[1], partial[2], index,
        tokens_out, result, rows, splits, SPLITS=MAX_SPLITS,
    )  # fmt: skip
    return result
