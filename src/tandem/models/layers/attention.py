"""Causal self-attention over packed rows, keyed by document boundaries instead of a dense mask.

A packed micro-batch is [rows, width] tokens; each row holds several documents whose position
ids restart at 0 (trailing padding is one more document). `PackedDocs` is computed once per
forward from the position ids and shared by every layer. A token attends to the tokens at or
before it in its own document, and to nothing else, whichever backend runs:

- `flex`: flex_attention with a document block mask (compiled; blocks that are entirely masked
  are skipped, so cost follows the documents' own lengths). CUDA only: torch has no flex
  backward on CPU.
- `varlen`: torch's variable-length flash kernel over the flattened rows, keyed by cu_seqlens
  (CUDA, bf16/fp16 only).
- `cudnn`: cuDNN's variable-length kernels through NVIDIA's cuDNN frontend package, keyed by
  cu_seqlens like `varlen` (CUDA, bf16/fp16; optional package; layers/cudnn_attention.py).
- `flash`: FlashAttention 4's variable-length kernels (FlashAttention 3's design on Hopper),
  keyed by cu_seqlens like `varlen` (CUDA, bf16/fp16; optional package; layers/flash_attention.py).
- `sdpa_docs`: one scaled_dot_product_attention call per document (exact, any device; slow
  when there are many short documents).
- `sdpa`: one SDPA call per row with a dense block-diagonal causal mask [rows, 1, width, width]
  (what transformers does for packed rows; the CPU default).

`auto` picks `sdpa` on CPU and, on CUDA, the backend measured fastest on an H200 with
benchmarks/trainer_mfu.py (docs/trainer.md has the comparison).

Shared prompts (transport/rollouts.py): a document may hold one prompt and several branches, a
branch starting where a position does not increase and is not 0. With `shared_prompts` a token
attends, within its document and causally, to its own segment (the prompt and first branch, or
a later branch) and to the tokens before its segment's first position: a later branch sees the
prompt, not the branches before it. Without branches that is the rule above. The masked
backends (`sdpa`, `flex`) do this; the others refuse it.

Under ring context parallelism (models/context_parallel.py) a rank's queries are only some
columns of each row (`query_columns`) while its keys and values are the whole row; the same rule
then holds with every column's global index: query column c attends to key column j iff j ≤ c
in c's document. The per-document backends then run one segment per run of consecutive query
columns within a document, against that document's keys up to the segment's last column.
"""

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from tandem.models.layers.cudnn_attention import (
    cudnn_buckets,
    cudnn_causal,
    require_cudnn_frontend,
    rounded_lengths,
)
from tandem.models.layers.flash_attention import flash_causal, require_flash_attention

AttentionBackend = Literal["auto", "flex", "varlen", "cudnn", "flash", "sdpa", "sdpa_docs"]
CUDA_DEFAULT = "flex"
"""The fastest backend for packed documents on an H200 (docs/trainer.md, "Attention")."""


def resolve_backend(backend: str, device: torch.device, compute_dtype: torch.dtype | None = None) -> str:
    """The backend `auto` stands for; a one-line ValueError for one that cannot run here (CUDA
    only, its package missing, or a half-precision kernel asked to compute in `compute_dtype`)."""
    if backend == "auto":
        return CUDA_DEFAULT if device.type == "cuda" else "sdpa"
    if backend in ("varlen", "flex", "cudnn", "flash") and device.type != "cuda":
        raise ValueError(
            f"model.attention = {backend!r} trains on CUDA only (use 'sdpa' or 'sdpa_docs' on CPU)"
        )
    if backend in ("varlen", "cudnn", "flash") and compute_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(
            f"model.attention = {backend!r} computes in bfloat16 or float16 only, and this trainer computes "
            f"in {str(compute_dtype).removeprefix('torch.')} (use 'flex' or 'sdpa_docs')"
        )
    if backend == "cudnn":
        require_cudnn_frontend()
    if backend == "flash":
        require_flash_attention()
    return backend


@dataclass
class PackedDocs:
    """Where the documents of a packed batch start and end, in the form the backend needs.

    Only what the backend reads is computed: the varlen and per-document paths need the
    boundaries on the host (a device sync, once per forward), the masked paths do not.
    """

    backend: str
    cu_seqlens: torch.Tensor | None = None  # varlen, cudnn, flash, sdpa_docs: int32 [docs + 1], offsets
    max_seqlen: int = 0  # varlen, cudnn, flash: the longest document (cudnn, flash: rounded up)
    mask: torch.Tensor | None = None  # sdpa: [rows, 1, queries, width] bool, True = attend
    block_mask: object | None = None  # flex: a BlockMask
    # only with query_columns (per-document backends): each segment's keys, flattened
    cu_seqlens_k: torch.Tensor | None = None  # int32 [segments + 1], offsets into kv_index
    max_seqlen_k: int = 0
    kv_index: torch.Tensor | None = None  # the flattened key rows of every segment, in order

    @classmethod
    def from_positions(
        cls,
        position_ids: torch.Tensor,
        backend: str,
        query_columns: torch.Tensor | None = None,
        shared_prompts: bool = False,
    ) -> "PackedDocs":
        """From the whole rows' position ids; `query_columns` (ascending): the columns whose
        queries this rank computes (ring context parallelism), None = all of them;
        `shared_prompts`: documents may hold branches (see the module docstring)."""
        rows, width = position_ids.shape
        starts = position_ids == 0
        starts[:, 0] = True  # a row always begins a document
        if shared_prompts and (backend not in ("sdpa", "flex") or query_columns is not None):
            raise ValueError(
                f"rows with shared prompts need the 'sdpa' or 'flex' attention backend without context "
                f"parallelism (got {backend!r}{' under context parallelism' if query_columns is not None else ''})"
            )
        if backend in ("sdpa", "flex"):
            doc_ids = starts.cumsum(dim=1)
            branches = _branches(position_ids, starts) if shared_prompts else None
            if backend == "flex":
                flex_branches = None if branches is None else (*branches, position_ids)
                return cls(backend, block_mask=_document_block_mask(doc_ids, query_columns, flex_branches))
            keys = torch.arange(width, device=position_ids.device)
            queries = keys if query_columns is None else query_columns
            allowed = (doc_ids[:, queries, None] == doc_ids[:, None, :]) & (keys[None, :] <= queries[:, None])
            if branches is not None:
                segment, first_position = branches
                allowed &= (segment[:, :, None] == segment[:, None, :]) | (
                    position_ids[:, None, :] < first_position[:, :, None]
                )
            return cls(backend, mask=allowed[:, None])
        if query_columns is not None:
            docs = _query_segments(starts, query_columns, backend)
        else:
            flat_starts = starts.flatten().nonzero().flatten()
            total = torch.tensor([rows * width], device=position_ids.device)
            cu_seqlens = torch.cat([flat_starts, total]).to(torch.int32)
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            docs = cls(backend, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if backend == "cudnn":  # here, not in the (compiled) layers: see layers/cudnn_attention.py
            docs = dataclasses.replace(docs, **cudnn_buckets(docs))
        if backend == "flash":
            docs = dataclasses.replace(docs, **rounded_lengths(docs))
        return docs

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """What every attention layer calls; context parallelism wraps it (models/context_parallel.py)."""
        return packed_attention(q, k, v, self, scale)


def _query_segments(starts: torch.Tensor, queries: torch.Tensor, backend: str) -> PackedDocs:
    """Segments for the per-document backends when the queries are some columns of each row: a
    segment is a run of consecutive query columns in one document; its keys run from the
    document's first column to the segment's last (so causal is aligned at the bottom right)."""
    rows, width = starts.shape
    columns = torch.arange(width, device=starts.device)
    doc_start = torch.where(starts, columns, 0).cummax(dim=1).values
    new_segment = starts[:, queries].clone()
    new_segment[:, 0] = True
    new_segment[:, 1:] |= (queries[1:] != queries[:-1] + 1)[None]
    n = len(queries)
    first = new_segment.flatten().nonzero().flatten()
    cu_q = torch.cat([first, first.new_tensor([rows * n])])
    row = first // n
    key_begin = row * width + doc_start[row, queries[first % n]]
    key_len = row * width + queries[(cu_q[1:] - 1) % n] + 1 - key_begin
    cu_k = torch.cat([key_len.new_zeros(1), key_len.cumsum(0)])
    offsets = torch.arange(int(cu_k[-1]), device=starts.device)
    kv_index = offsets + torch.repeat_interleave(key_begin - cu_k[:-1], key_len)
    return PackedDocs(
        backend,
        cu_seqlens=cu_q.to(torch.int32),
        max_seqlen=int((cu_q[1:] - cu_q[:-1]).max()),
        cu_seqlens_k=cu_k.to(torch.int32),
        max_seqlen_k=int(key_len.max()),
        kv_index=kv_index,
    )


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocs, scale: float
) -> torch.Tensor:
    """q [rows, width, heads, d], k/v [rows, width, kv_heads, d] → [rows, width, heads, d]."""
    if docs.backend == "sdpa":
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), docs.mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)
    if docs.backend == "flex":
        out = _flex_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            block_mask=docs.block_mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2)
    rows, width, heads, dim = q.shape
    q = q.reshape(rows * width, heads, dim)
    k, v = (t.reshape(-1, t.shape[2], dim) for t in (k, v))
    if docs.kv_index is not None:
        k, v = k[docs.kv_index], v[docs.kv_index]
    if docs.backend in ("varlen", "cudnn", "flash"):
        kernel = {"varlen": varlen_causal, "cudnn": cudnn_causal, "flash": flash_causal}[docs.backend]
        out = kernel(q, k, v, docs.cu_seqlens, docs.max_seqlen, scale, docs.cu_seqlens_k, docs.max_seqlen_k)
    elif docs.backend == "sdpa_docs":
        key_bounds = docs.cu_seqlens if docs.cu_seqlens_k is None else docs.cu_seqlens_k
        out = _per_document_sdpa(q, k, v, docs.cu_seqlens.tolist(), key_bounds.tolist(), scale)
    else:
        raise ValueError(f"unknown attention backend {docs.backend!r}")
    return out.view(rows, width, heads, dim)


def _per_document_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], key_bounds: list[int], scale: float
) -> torch.Tensor:
    """One SDPA call per segment; a segment with fewer queries than keys holds the last queries
    of its keys (causal aligned at the bottom right)."""
    outs = []
    for (start, end), (k_start, k_end) in zip(
        zip(bounds[:-1], bounds[1:], strict=True),
        zip(key_bounds[:-1], key_bounds[1:], strict=True),
        strict=True,
    ):
        qd = q[start:end].transpose(0, 1)[None]
        kd, vd = (t[k_start:k_end].transpose(0, 1)[None] for t in (k, v))
        n, m = end - start, k_end - k_start
        mask = None if n == m else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        outs.append(
            F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
        )
    return torch.cat([o[0].transpose(0, 1) for o in outs])


def varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """Causal attention of each segment of the flattened rows (q [T, heads, d], k and v
    [T_k, kv_heads, d]; int32 offsets) with torch's variable-length flash kernel (CUDA, bf16/fp16).
    Grouped-query heads go to the kernel where it takes them, else KV heads are repeated."""
    from torch.nn.attention.varlen import varlen_attn

    extra = {}
    if q.shape[1] != k.shape[1]:
        if _varlen_supports_gqa():
            extra["enable_gqa"] = True
        else:  # older torch: repeat each KV head for its query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    # keys segmented as the queries unless their own offsets are given
    cu_k, n_k = (cu_seqlens, max_seqlen) if cu_seqlens_k is None else (cu_seqlens_k, max_seqlen_k)
    # causal = window (-1, 0), aligned at the bottom right when a segment has fewer queries than keys
    return varlen_attn(q, k, v, cu_seqlens, cu_k, max_seqlen, n_k, scale=scale, window_size=(-1, 0), **extra)


@functools.cache
def _varlen_supports_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def branch_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where a shared prompt's later branch starts: a position that neither increases nor is 0."""
    later, earlier = position_ids[:, 1:], position_ids[:, :-1]
    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = (later <= earlier) & (later != 0)
    return starts


def _branches(position_ids: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's segment id (a document, or a branch after its first) and its segment's first
    position: a token sees another segment's tokens only below that position."""
    segment_start = starts | branch_starts(position_ids)
    columns = torch.arange(position_ids.shape[1], device=position_ids.device)
    first_column = torch.where(segment_start, columns, 0).cummax(dim=1).values
    return segment_start.cumsum(dim=1), position_ids.gather(1, first_column)


def _document_block_mask(
    doc_ids: torch.Tensor,
    query_columns: torch.Tensor | None,
    branches: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> object:
    """The flex block mask of the documents; with `branches` (segment ids, each segment's first
    position, the positions) the shared-prompt rule of the module docstring."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    def same_document_branch_causal(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        segment, first_position, positions = branches
        visible = (segment[b, q] == segment[b, kv]) | (positions[b, kv] < first_position[b, q])
        return same_document_causal(b, h, q, kv) & visible

    def of_query_columns(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return same_document_causal(b, h, query_columns[q], kv)

    rows, width = doc_ids.shape
    mask_mod, queries = (
        (same_document_causal, width) if query_columns is None else (of_query_columns, len(query_columns))
    )
    if branches is not None:
        mask_mod = same_document_branch_causal
    return create_block_mask(
        mask_mod, rows, None, queries, width, device=doc_ids.device, _compile=doc_ids.is_cuda
    )


@functools.cache
def _compiled_flex() -> object:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_attention(*args: object, **kwargs: object) -> torch.Tensor:
    """flex_attention, compiled (eager flex materialises the scores; it is only a reference)."""
    return _compiled_flex()(*args, **kwargs)
