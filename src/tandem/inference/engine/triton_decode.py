"""Triton kernels for decode attention over the paged KV cache (CUDA).

One program per (sequence, group of HEADS adjacent KV heads): it loads the query heads that
share those KV heads, walks the sequence's blocks BLOCK_N tokens at a time with an online
softmax, and reads every key and value once, straight from the cache (no gathered copy).
With HEADS > 1 a token's keys of the group are one contiguous row of HEADS × head_dim (the
cache's layout is [block, token, kv head, dim]); the queries are laid out block-diagonally
(row r, a query head of KV head j, is zero outside j's columns), so one matmul scores every
query head against its own KV head, and each row keeps only its own columns of the output.
`KV_HEAD_FASTEST` orders the programs so that the groups of one sequence run side by side (the
cache rows of a block are read together).

Two forms of the one kernel, by the number of programs (`decode_splits`):

- SPLITS = 1: each program walks its sequence's whole context and writes the output.
- SPLITS > 1 ("flash decoding"), when batch × groups programs are too few to keep the GPU's
  memory busy (small batches, long contexts): a third grid axis, program s walking tokens
  [s × chunk, (s + 1) × chunk) with chunk = cdiv(cdiv(ctx, SPLITS), BLOCK_N) × BLOCK_N computed
  in the kernel from the sequence's context; it writes its unnormalized fp32 partials (running
  max, denominator, weighted sum of values), and `_combine_kernel` rescales them to the common
  maximum and writes the output. A split past the context writes m = -inf, denominator and sum
  0, which the combine weighs by 0.

SPLITS is chosen on the host from the batch size and head layout alone, never from the contexts
(which live on the GPU and grow every step): the grid and the workspace are fixed per batch, so
CUDA graphs capture either path. The kernels run on CPU under TRITON_INTERPRET=1, which is how
they are tested without a GPU.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    m_ptr,
    denom_ptr,
    scale,
    stride_q_batch,
    stride_q_head,
    stride_kv_block,
    stride_kv_token,
    stride_kv_head,
    stride_table,
    stride_out_split,
    stride_m_split,
    stride_m_batch,
    GROUP: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_HEAD_FASTEST: tl.constexpr,
    IEEE: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One (sequence, KV-head group). SPLITS = 1: its whole context, the normalized output to
    `out_ptr` (laid out like q). SPLITS > 1: split `program_id(2)` of the context, its fp32
    partials: the unnormalized sum of values to `out_ptr` ([SPLITS, *q.shape]), the running max and
    denominator to `m_ptr` and `denom_ptr` ([SPLITS, batch, heads]); a split without tokens writes
    m = -inf, denominator and sum 0."""
    if KV_HEAD_FASTEST:
        head_group, seq = tl.program_id(0), tl.program_id(1)
    else:
        seq, head_group = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    if SPLITS == 1:
        lo, hi = 0, ctx
    else:  # whole BLOCK_N tiles: the splits' tiles are the single kernel's (the last one partial)
        chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.program_id(2) * chunk
        hi = tl.minimum(ctx, lo + chunk)
    r = tl.arange(0, ROWS_PAD)  # query rows: HEADS × GROUP real ones
    c = tl.arange(0, HEADS * HEAD_DIM)  # the group's key columns: HEADS × HEAD_DIM
    row_real = r < HEADS * GROUP
    own = ((r // GROUP)[:, None] == (c // HEAD_DIM)[None, :]) & row_real[:, None]  # [rows, cols]
    heads = head_group * HEADS * GROUP + r
    q_offsets = seq * stride_q_batch + heads[:, None] * stride_q_head + (c % HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_offsets, mask=own, other=0.0)
    kv_cols = (head_group * HEADS + c // HEAD_DIM) * stride_kv_head + c % HEAD_DIM
    table = tables_ptr + seq * stride_table
    m = tl.full([ROWS_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([ROWS_PAD], tl.float32)
    acc = tl.zeros([ROWS_PAD, HEADS * HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=valid, other=0)
        kv_rows = block * stride_kv_block + (n % BLOCK_SIZE) * stride_kv_token
        kv_offsets = kv_rows[:, None] + kv_cols[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=valid[:, None], other=0.0)
        if IEEE:  # noqa: SIM108 (a compile-time branch of the kernel)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile of the range has a token
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if SPLITS == 1:
        out = acc / denom[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=own)
    else:
        split = tl.program_id(2)
        tl.store(out_ptr + split * stride_out_split + q_offsets, acc, mask=own)
        rows = split * stride_m_split + seq * stride_m_batch + heads
        tl.store(m_ptr + rows, m, mask=row_real)
        tl.store(denom_ptr + rows, denom, mask=row_real)


@triton.jit
def _combine_kernel(m_ptr, denom_ptr, acc_ptr, out_ptr, rows, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One (sequence, query head) row of `rows`: the splits' partials rescaled to their common
    max. Split 0 always holds a token (contexts are at least 1: padded rows of a batch attend to
    one slot), so that max is finite and a split without tokens (m = -inf) weighs exp(-inf) = 0:
    no NaN, no guard needed."""
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(m_ptr + s * rows + row)
    denom = tl.load(denom_ptr + s * rows + row)
    acc = tl.load(acc_ptr + (s * rows + row)[:, None] * HEAD_DIM + d[None, :])
    weight = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


# Launch parameters: the fastest of benchmarks/decode_attention.py's sweep on an H200 (2026-12-04,
# batch 256, context 384: 107 µs, 3.75 TB/s of keys and values; the one before, 64 tokens, 2
# warps, sequence-major, 116 µs). Several KV heads per program were no faster there. Without a
# "splits" entry the split count is `decode_splits`'s.
CONFIG = {"BLOCK_N": 128, "HEADS": 1, "KV_HEAD_FASTEST": True, "num_warps": 4, "num_stages": 3}

# Programs below which the context is split. Measured on H100s (2026-12-07, Qwen3-8B's 32/8 heads,
# benchmarks/decode_attention.py --splits): 8 sequences (64 programs) of 4,096 tokens take 94.4 µs
# unsplit at 128-token tiles (1.42 TB/s), 63.5 in 4 splits (2.11 TB/s); 32 sequences gain 3–11 %
# in 2 splits, which decode through the engine did not show (−4 %, one run); 64 sequences (512
# programs) and more are fastest unsplit. A split program walks fewer tokens, so its start and end
# cost more per byte, and the combine is one more launch: split only where most of the GPU would
# sit idle. Through the engine, 8 concurrent requests of 3,800-token prompts decode 14 % faster.
TARGET_PROGRAMS = 256
# At most this many splits: each writes fp32 partials the combine reads back, and at short
# contexts most splits of a large count hold no tokens (they still launch).
MAX_SPLITS = 32


def decode_splits(batch: int, groups: int) -> int:
    """The split count for `batch` sequences of `groups` programs each: 1 when they make
    TARGET_PROGRAMS, else the smallest power of two that reaches it, at most MAX_SPLITS. Never
    from the contexts, so that a CUDA graph of the batch holds for every step."""
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, batch * groups)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    config: dict | None = None,
) -> torch.Tensor:
    """q: [B, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]. `config`
    (default CONFIG): the launch parameters; HEADS is capped at the largest divisor of kv_heads,
    and "splits" (a power of two; default `decode_splits`) divides each context among programs."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    config = dict(CONFIG if config is None else config)
    per_program = config.pop("HEADS")
    while kv_heads % per_program:
        per_program //= 2
    kv_head_fastest = config.pop("KV_HEAD_FASTEST")
    groups = kv_heads // per_program
    splits = config.pop("splits", None)
    if splits is None:
        splits = decode_splits(batch, groups)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    q = q.contiguous()
    out = torch.empty_like(q)
    grid = (groups, batch) if kv_head_fastest else (batch, groups)
    strides = (q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0))
    constants = dict(
        GROUP=group,
        ROWS_PAD=max(16, triton.next_power_of_2(per_program * group)),
        HEADS=per_program,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        KV_HEAD_FASTEST=kv_head_fastest,
        IEEE=q.dtype == torch.float32,
        **config,
    )
    if splits == 1:  # m_ptr and denom_ptr unused: `out` stands in
        _decode_kernel[grid](
            q, k_cache, v_cache, block_tables, context_lens, out, out, out, scale, *strides, 0, 0, 0,
            **constants, SPLITS=1,
        )  # fmt: skip
        return out
    # fp32 partials, fresh each call: inside a CUDA graph they come from its memory pool
    acc = torch.empty(splits, *q.shape, dtype=torch.float32, device=q.device)
    m = torch.empty(splits, batch, heads, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    _decode_kernel[(*grid, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, denom, scale, *strides,
        acc.stride(0), m.stride(0), m.stride(1), **constants, SPLITS=splits,
    )  # fmt: skip
    _combine_kernel[(batch * heads,)](m, denom, acc, out, batch * heads, SPLITS=splits, HEAD_DIM=head_dim)
    return out
