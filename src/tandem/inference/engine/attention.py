"""Attention over the paged KV cache.

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and the
same for values; token `p` of a sequence lives in slot `block_table[p // block_size] * block_size
+ p % block_size`. A step's new keys and values are written to their slots first; then each sequence
attends by the cheapest path that fits it. The step's rows hold the decodes first, then the
whole prompts, then the chunks (model_runner.py), so decodes and prompts are each one run of
rows, taken as a view:

- decodes (one new token): one batched call. On CUDA a Triton kernel reads keys and values
  straight from the blocks; elsewhere the blocks are gathered and one masked SDPA call serves
  the batch. Shapes are fixed per batch bucket, so a CUDA graph captures a pure decode step.
- whole prompts (nothing cached yet): one SDPA call over a padded batch of the new keys and
  values, without reading the cache (prompts of one length: a view of their rows, no padding);
  or (`engine.prompt_attention = varlen`) one variable-length flash call over their rows as they
  lie in the step, with no padding (on CPU one SDPA call per prompt).
- continued prompt chunks (prefix-cache hits, chunked prefill, recompute after preemption): one
  SDPA call over a padded batch of their gathered blocks, with causal masks offset by what is
  cached (split into groups when the gathered keys would be large).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.models.layers.attention import varlen_causal

try:  # the CUDA decode kernel; without Triton, decode uses the gather + SDPA path below
    from tandem.inference.engine.triton_decode import paged_decode_attention
except ImportError:
    paged_decode_attention = None


@dataclass
class Decodes:
    """Sequences with one new token each."""

    rows: slice | None  # their rows: the step's first ones; None when every row is a decode
    block_tables: torch.Tensor  # [B, width], padded with block 0
    context_lens: torch.Tensor  # [B]


@dataclass
class Prompts:
    """Whole prompts, as a padded batch of row indices into the step's tokens; prompts of one
    length (index None) are their rows as they lie, viewed as [B, L]."""

    index: torch.Tensor | None  # [B, L]; padding repeats a valid row
    mask: torch.Tensor | None  # [B, 1, L, L] causal and key padding; None when no row is padded
    rows: torch.Tensor | slice  # the step's token rows of the valid entries, in order
    picks: torch.Tensor | None  # their positions in the flattened [B * L] batch
    length: int  # L


@dataclass
class VarlenPrompts:
    """Whole prompts as segments of their rows: no padding, one variable-length kernel call."""

    rows: slice | None  # the step's token rows of the prompts; None: every row is a prompt's
    cu_seqlens: torch.Tensor  # int32 [B + 1]: where each prompt's rows start in `rows`
    max_len: int


@dataclass
class Chunks:
    """Prompt chunks that continue a cached prefix (a prefix-cache hit, chunked prefill,
    recomputation), as one padded batch over their gathered blocks: one SDPA call."""

    index: torch.Tensor  # [C, L] their rows among the step's tokens; padding repeats a valid row
    block_tables: torch.Tensor  # [C, W], padded with block 0
    mask: torch.Tensor  # [C, 1, L, W * block_size]: query i of chunk c sees key j ≤ its position
    rows: torch.Tensor  # the step's token rows of the valid entries, in order
    picks: torch.Tensor  # their positions in the flattened [C * L] batch
    grouped_mask: torch.Tensor | None = None  # `mask` per query head of a KV head (built once)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [T] cache slot each new token's key/value is written to (None:
    # written already, by a piece before attention: piecewise.py)
    decodes: Decodes | None = None
    prompts: Prompts | VarlenPrompts | None = None
    chunks: list[Chunks] = field(default_factory=list)  # groups small enough to gather at once
    index_choice: list[torch.Tensor] | None = None  # GLM-5: the last indexer's chosen keys, per group


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, dim], k and v: [T, kv_heads, dim] for the step's new tokens, whose keys and
    values are already in the cache (`write_kv`). The result [T, heads, dim] goes into `out` when
    given (a buffer the next graphed piece reads: piecewise.py)."""
    d = meta.decodes
    p = meta.prompts
    whole = None
    if d is not None and d.rows is None:
        whole = decode_attention(q, k_cache, v_cache, d.block_tables, d.context_lens, scale)
    elif isinstance(p, VarlenPrompts) and p.rows is None:  # every row is a whole prompt's
        whole = _segments(q, k, v, p, scale)
    if whole is not None:
        return whole if out is None else out.copy_(whole)
    out = torch.empty_like(q) if out is None else out
    if d is not None:
        out[d.rows] = decode_attention(q[d.rows], k_cache, v_cache, d.block_tables, d.context_lens, scale)
    if meta.prompts is not None:
        _prompt_attention(q, k, v, meta.prompts, scale, out)
    for chunks in meta.chunks:
        _chunk_attention(q, k_cache, v_cache, chunks, scale, out)
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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: Prompts | VarlenPrompts,
    scale: float,
    out: torch.Tensor,
) -> None:
    if isinstance(p, VarlenPrompts):  # (rows is None only in a step of prompts alone: paged_attention)
        out[p.rows] = _segments(q[p.rows], k[p.rows], v[p.rows], p, scale)
        return
    if p.index is None:  # prompts of one length, side by side: a view of their rows
        qp, kp, vp = (t[p.rows].unflatten(0, (-1, p.length)).transpose(1, 2) for t in (q, k, v))
    else:
        qp, kp, vp = (t[p.index].transpose(1, 2) for t in (q, k, v))  # [B, heads, L, d]
    if p.mask is None:  # equal lengths: plain causal attention (flash kernels)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    else:  # memory-efficient kernels take a mask but not grouped heads: repeat the KV heads
        group = qp.shape[1] // kp.shape[1]
        kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale)
    o = o.transpose(1, 2)  # [B, L, heads, d]
    if p.picks is None:  # prompts of one length: one strided copy into their rows
        out[p.rows].unflatten(0, (-1, p.length)).copy_(o)
    else:
        out[p.rows] = o.flatten(0, 1)[p.picks]  # (indices from the host: no sync)


def _segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPrompts, scale: float
) -> torch.Tensor:
    """Causal attention within each prompt's run of rows. torch's variable-length kernel is
    CUDA-only; elsewhere one SDPA call per prompt (exact, slow: for checking the layout on CPU)."""
    if q.is_cuda:
        return varlen_causal(q, k, v, p.cu_seqlens, p.max_len, scale)
    bounds = p.cu_seqlens.tolist()
    return torch.cat([
        F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ])  # fmt: skip


def _chunk_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: Chunks, scale: float, out: torch.Tensor
) -> None:
    """The query heads of a KV head are laid out as that head's query rows (as in decode), so
    grouped-query attention needs no repeated keys."""
    count, length = c.index.shape
    heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    k = k_cache[c.block_tables].flatten(1, 2).transpose(1, 2)  # [C, kv_heads, W * block_size, d]
    v = v_cache[c.block_tables].flatten(1, 2).transpose(1, 2)
    qg = q[c.index].view(count, length, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(count, kv_heads, group * length, dim)
    if c.grouped_mask is None:
        c.grouped_mask = c.mask.repeat(1, 1, group, 1)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=c.grouped_mask, scale=scale)
    o = o.view(count, kv_heads, group, length, dim).permute(0, 3, 1, 2, 4).reshape(count * length, heads, dim)
    out[c.rows] = o[c.picks]
