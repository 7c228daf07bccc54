"""Attention over the paged KV cache.

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and the
same for values; token `p` of a sequence lives in slot `block_table[p // block_size] * block_size
+ p % block_size`. A step's new keys and values are written to their slots first; then each sequence
attends by the cheapest path that fits it:

- decodes (one new token): one batched call. On CUDA a Triton kernel reads keys and values
  straight from the blocks; elsewhere the blocks are gathered and one masked SDPA call serves
  the batch. Shapes are fixed per batch bucket, so a CUDA graph captures a pure decode step.
- whole prompts (nothing cached yet): one SDPA call over a padded batch of the new keys and
  values, without reading the cache.
- continued prompt chunks (chunked prefill, recompute after preemption): one SDPA call per
  sequence over its gathered blocks, with a causal mask offset by what is cached.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:  # the CUDA decode kernel; without Triton, decode uses the gather + SDPA path below
    from tandem.inference.engine.triton_decode import paged_decode_attention
except ImportError:
    paged_decode_attention = None


@dataclass
class Decodes:
    """Sequences with one new token each."""

    rows: torch.Tensor | None  # their rows among the step's tokens; None when every row is a decode
    block_tables: torch.Tensor  # [B, width], padded with block 0
    context_lens: torch.Tensor  # [B]


@dataclass
class Prompts:
    """Whole prompts, as a padded batch of row indices into the step's tokens."""

    index: torch.Tensor  # [B, L]; padding repeats a valid row
    mask: torch.Tensor | None  # [B, 1, L, L] causal and key padding; None when no row is padded
    rows: torch.Tensor  # the step's token rows of the valid entries, in order
    picks: torch.Tensor  # their positions in the flattened [B * L] batch


@dataclass
class Chunks:
    """Prompt chunks that continue a cached prefix: one SDPA call each."""

    starts: list[int]  # first row of each chunk among the step's tokens
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's key/value is written to
    decodes: Decodes | None = None
    prompts: Prompts | None = None
    chunks: Chunks | None = None


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, dim], k and v: [T, kv_heads, dim] for the step's new tokens, whose keys and
    values are already in the cache (`write_kv`)."""
    d = meta.decodes
    if d is not None and d.rows is None:
        return decode_attention(q, k_cache, v_cache, d.block_tables, d.context_lens, scale)
    out = torch.empty_like(q)
    if d is not None:
        out[d.rows] = decode_attention(q[d.rows], k_cache, v_cache, d.block_tables, d.context_lens, scale)
    if meta.prompts is not None:
        _prompt_attention(q, k, v, meta.prompts, scale, out)
    if meta.chunks is not None:
        _chunk_attention(q, k_cache, v_cache, meta.chunks, scale, out)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, heads, dim], one new token per sequence (already written to the cache).

    In the gather path the query heads sharing a KV head are laid out as that head's "query
    length", so one SDPA call serves grouped-query attention without repeating keys.
    """
    if q.is_cuda and paged_decode_attention is not None:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[block_tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, width * block_size, d]
    v = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None]
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(batch, heads, dim)


def _prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Prompts, scale: float, out: torch.Tensor
) -> None:
    qp, kp, vp = (t[p.index].transpose(1, 2) for t in (q, k, v))  # [B, heads, L, d]
    if p.mask is None:  # equal lengths: plain causal attention (flash kernels)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    else:  # memory-efficient kernels take a mask but not grouped heads: repeat the KV heads
        group = qp.shape[1] // kp.shape[1]
        kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale)
    out[p.rows] = o.transpose(1, 2).flatten(0, 1)[p.picks]  # (indices from the host: no sync)


def _chunk_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: Chunks, scale: float, out: torch.Tensor
) -> None:
    for start, q_len, ctx_len, blocks in zip(
        c.starts, c.query_lens, c.context_lens, c.block_tables, strict=True
    ):
        k = k_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)  # [kv_heads, ctx, d]
        v = v_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
        rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
        qs = q[start : start + q_len].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.transpose(0, 1)
