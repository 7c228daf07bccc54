"""A Triton kernel for decode attention over the paged KV cache (CUDA).

One program per (sequence, group of HEADS adjacent KV heads): it loads the query heads that
share those KV heads, walks the sequence's blocks BLOCK_N tokens at a time with an online
softmax, and reads every key and value once, straight from the cache (no gathered copy).
With HEADS > 1 a token's keys of the group are one contiguous row of HEADS × head_dim (the
cache's layout is [block, token, kv head, dim]); the queries are laid out block-diagonally
(row r, a query head of KV head j, is zero outside j's columns), so one matmul scores every
query head against its own KV head, and each row keeps only its own columns of the output.
`KV_HEAD_FASTEST` orders the programs so that the groups of one sequence run side by side (the
cache rows of a block are read together). Shapes are fixed per batch, so CUDA graphs capture
it. The same kernel runs on CPU under TRITON_INTERPRET=1, which is how it is tested without a GPU.
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
    scale,
    stride_q_batch,
    stride_q_head,
    stride_kv_block,
    stride_kv_token,
    stride_kv_head,
    stride_table,
    GROUP: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_HEAD_FASTEST: tl.constexpr,
    IEEE: tl.constexpr,
):
    if KV_HEAD_FASTEST:
        head_group, seq = tl.program_id(0), tl.program_id(1)
    else:
        seq, head_group = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    r = tl.arange(0, ROWS_PAD)  # query rows: HEADS × GROUP real ones
    c = tl.arange(0, HEADS * HEAD_DIM)  # the group's key columns: HEADS × HEAD_DIM
    row_real = r < HEADS * GROUP
    own = ((r // GROUP)[:, None] == (c // HEAD_DIM)[None, :]) & row_real[:, None]  # [rows, cols]
    heads = head_group * HEADS * GROUP + r
    q_offsets = seq * stride_q_batch + heads[:, None] * stride_q_head + (c % HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_offsets, mask=own, other=0.0)
    kv_cols = (head_group * HEADS + c // HEAD_DIM) * stride_kv_head + c % HEAD_DIM
    m = tl.full([ROWS_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([ROWS_PAD], tl.float32)
    acc = tl.zeros([ROWS_PAD, HEADS * HEAD_DIM], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < ctx
        block = tl.load(tables_ptr + seq * stride_table + n // BLOCK_SIZE, mask=valid, other=0)
        kv_rows = block * stride_kv_block + (n % BLOCK_SIZE) * stride_kv_token
        kv_offsets = kv_rows[:, None] + kv_cols[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=valid[:, None], other=0.0)
        if IEEE:  # noqa: SIM108 (a compile-time branch of the kernel)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=own)


# Launch parameters: the fastest of benchmarks/decode_attention.py's sweep on an H200 (2026-12-04,
# batch 256, context 384: 107 µs, 3.75 TB/s of keys and values; the one before, 64 tokens, 2
# warps, sequence-major, 116 µs). Several KV heads per program were no faster there.
CONFIG = {"BLOCK_N": 128, "HEADS": 1, "KV_HEAD_FASTEST": True, "num_warps": 4, "num_stages": 3}


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
    (default CONFIG): the launch parameters; HEADS is capped at the largest divisor of kv_heads."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    config = dict(CONFIG if config is None else config)
    per_program = config.pop("HEADS")
    while kv_heads % per_program:
        per_program //= 2
    kv_head_fastest = config.pop("KV_HEAD_FASTEST")
    groups = kv_heads // per_program
    q = q.contiguous()
    out = torch.empty_like(q)
    grid = (groups, batch) if kv_head_fastest else (batch, groups)
    _decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        ROWS_PAD=max(16, triton.next_power_of_2(per_program * group)),
        HEADS=per_program,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        KV_HEAD_FASTEST=kv_head_fastest,
        IEEE=q.dtype == torch.float32,
        **config,
    )
    return out
