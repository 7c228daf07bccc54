"""Attention over the paged KV cache.

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and the
same for values; token `p` of a sequence lives in slot `block_table[p // block_size] * block_size
+ p % block_size`. Two paths:

- `varlen_attention`: any mix of prefill chunks and decodes, one SDPA call per sequence over
  its gathered blocks (flash/efficient kernels when the chunk is a whole prompt).
- `decode_attention`: one new token per sequence, batched with fixed shapes (block tables
  padded to a fixed width), so a CUDA graph can capture it for a batch-size bucket. On CUDA a
  Triton kernel reads keys and values straight from the blocks; elsewhere the blocks are
  gathered and one masked SDPA call serves the whole batch.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # the CUDA decode kernel; without Triton, decode uses the gather + SDPA path below
    from tandem.inference.engine.triton_decode import paged_decode_attention
except ImportError:
    paged_decode_attention = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's key/value is written to
    # varlen path (host-side lists)
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]  # per sequence, its blocks (on device)
    # decode path (device tensors of fixed shape)
    decode: bool = False
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def varlen_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, heads, head_dim] for the new tokens of all sequences, back to back."""
    out = torch.empty_like(q)
    start = 0
    for q_len, ctx_len, blocks in zip(meta.query_lens, meta.context_lens, meta.block_tables, strict=True):
        k = k_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)  # [kv_heads, ctx, d]
        v = v_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
        qs = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, d]
        if q_len == ctx_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [B, heads, head_dim], one new token per sequence (already written to the cache).

    In the gather path the query heads sharing a KV head are laid out as that head's "query length", so one
    unmasked-by-causality SDPA call serves grouped-query attention without repeating keys.
    """
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    assert tables is not None and lens is not None
    if q.is_cuda and paged_decode_attention is not None:
        return paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, max_ctx, d]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(batch, heads, dim)
