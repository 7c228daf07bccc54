"""One-pass sampling on CUDA: temperature, exponential-race draw and the drawn token's logprob.

The torch sampler (sampler.py) makes ~12 passes over the `[rows, vocab]` logits (cast to
float32, log_softmax, exp, noise, divide, argmax, gather); this kernel reads the logits once,
in their own dtype. Each program walks a slice of one row's vocabulary keeping an online
softmax (max and sum of exponentials) and the best race score `x / T - log(-log u)`, where `u`
is the counter-based uniform of sampler.py (the same bits: a seeded row draws what the torch
path draws up to float rounding); a second, tiny program per row combines the slices. Greedy
rows (T ≤ 0) score the plain logit. Rows without a seed use a key derived from a per-step seed
and the row, so unseeded noise costs nothing extra either.

It covers rows without top-k, top-p, min-p and alternatives (`SamplingRows.fused`); other
batches take the torch path. Tested on CPU under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

SPLITS = 16  # most programs per row (a power of two)
BLOCK = 1024


@triton.jit
def _fmix32(x):
    """MurmurHash3's finaliser on uint32 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["step_seed"])
def _partial_kernel(
    logits_ptr, stride, temps_ptr, keys_ptr, positions_ptr, step_seed, vocab,
    max_ptr, sum_ptr, best_ptr, index_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0.0
    t_eff = tl.where(greedy, 1.0, temp)
    key = tl.load(keys_ptr + row)
    seeded = key >= 0
    unseeded_key = _fmix32(step_seed.to(tl.uint32) ^ _fmix32((row + 0x2545F491).to(tl.uint32)))
    key32 = tl.where(seeded, key.to(tl.uint32), unseeded_key)
    position = tl.load(positions_ptr + row).to(tl.uint32)
    row_hash = _fmix32(key32 ^ _fmix32(position))
    m = tl.full((), -1e30, tl.float32)
    total = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.zeros((), tl.int32)
    base = split * CHUNK
    for offset in range(0, CHUNK, BLOCK):
        cols = base + offset + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=valid, other=float("-inf"))
        x = x.to(tl.float32) / t_eff
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.where(valid, tl.exp(x - m_new), 0.0), axis=0)
        m = m_new
        h = row_hash + cols.to(tl.uint32) * 0x9E3779B9
        h = _fmix32(_fmix32(h) ^ row_hash)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(greedy, x, x - tl.log(-tl.log(u)))
        score = tl.where(valid, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0)
        better = block_best > best
        best_index = tl.where(better, base + offset + block_index, best_index)
        best = tl.maximum(best, block_best)
    out = row * SPLITS + split
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, total)
    tl.store(best_ptr + out, best)
    tl.store(index_ptr + out, best_index)


@triton.jit
def _combine_kernel(
    logits_ptr, stride, temps_ptr, max_ptr, sum_ptr, best_ptr, index_ptr, tokens_ptr, result_ptr, rows,
    SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    splits = row * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(max_ptr + splits)
    total = tl.load(sum_ptr + splits)
    best = tl.load(best_ptr + splits)
    index = tl.load(index_ptr + splits)
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(total * tl.exp(m - m_all), axis=0))
    token = tl.sum(tl.where(tl.arange(0, SPLITS) == tl.argmax(best, axis=0), index, 0), axis=0)
    temp = tl.load(temps_ptr + row)
    t_eff = tl.where(temp <= 0.0, 1.0, temp)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) / t_eff
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
    splits = min(SPLITS, triton.next_power_of_2(triton.cdiv(vocab, BLOCK)))
    chunk = BLOCK * triton.cdiv(triton.cdiv(vocab, splits), BLOCK)
    partial = torch.empty(3, rows * splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
    result = torch.empty(2, rows, dtype=torch.float64, device=logits.device)
    _partial_kernel[(rows, splits)](
        logits, logits.stride(0), temperatures, keys, positions, step_seed & 0x7FFFFFFF, vocab,
        partial[0], partial[1], partial[2], index,
        CHUNK=chunk, BLOCK=BLOCK, SPLITS=splits,
    )  # fmt: skip
    _combine_kernel[(rows,)](
        logits, logits.stride(0), temperatures, partial[0], partial[1], partial[2], index,
        tokens_out, result, rows, SPLITS=splits,
    )  # fmt: skip
    return result
