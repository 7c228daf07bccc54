"""A Triton kernel for decode attention over the paged KV cache (CUDA).

One program per (sequence, KV head): it loads the query heads that share the KV head, walks the
sequence's blocks BLOCK_N tokens at a time with an online softmax, and reads every key and
value once, straight from the cache (no gathered copy). Shapes are fixed per batch, so CUDA
graphs capture it. The same kernel runs on CPU under TRITON_INTERPRET=1, which is how it is
tested without a GPU.
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
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q_offsets = seq * stride_q_batch + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=(g < GROUP)[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < ctx
        block = tl.load(tables_ptr + seq * stride_table + n // BLOCK_SIZE, mask=valid, other=0)
        kv_offsets = block * stride_kv_block + (n % BLOCK_SIZE) * stride_kv_token + kv_head * stride_kv_head
        k = tl.load(k_ptr + kv_offsets[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets[:, None] + d[None, :], mask=valid[:, None], other=0.0)
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
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


# Launch parameters; benchmarks/engine_throughput.py --sweep-kernel measures the alternatives.
CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}  # fastest on an H200 (sweep)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    _decode_kernel[(batch, kv_heads)](
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
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        IEEE=q.dtype == torch.float32,
        **CONFIG,
    )
    return out
