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
- `sdpa_docs`: one scaled_dot_product_attention call per document (exact, any device; slow
  when there are many short documents).
- `sdpa`: one SDPA call per row with a dense block-diagonal causal mask [rows, 1, width, width]
  (what transformers does for packed rows; the CPU default).

`auto` picks `sdpa` on CPU and, on CUDA, the backend measured fastest on an H200 with
benchmarks/trainer_mfu.py (docs/trainer.md has the comparison).
"""

import functools
import inspect
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

AttentionBackend = Literal["auto", "flex", "varlen", "sdpa", "sdpa_docs"]
CUDA_DEFAULT = "flex"
"""The fastest backend for packed documents on an H200 (docs/trainer.md, "Attention")."""


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return CUDA_DEFAULT if device.type == "cuda" else "sdpa"
    if backend in ("varlen", "flex") and device.type != "cuda":
        raise ValueError(
            f"model.attention = {backend!r} trains on CUDA only (use 'sdpa' or 'sdpa_docs' on CPU)"
        )
    return backend


@dataclass
class PackedDocs:
    """Where the documents of a packed batch start and end, in the form the backend needs.

    Only what the backend reads is computed: the varlen and per-document paths need the
    boundaries on the host (a device sync, once per forward), the masked paths do not.
    """

    backend: str
    cu_seqlens: torch.Tensor | None = None  # varlen, sdpa_docs: int32 [docs + 1], flattened offsets
    max_seqlen: int = 0  # varlen: the longest document
    mask: torch.Tensor | None = None  # sdpa: [rows, 1, width, width] bool, True = attend
    block_mask: object | None = None  # flex: a BlockMask

    @classmethod
    def from_positions(cls, position_ids: torch.Tensor, backend: str) -> "PackedDocs":
        rows, width = position_ids.shape
        starts = position_ids == 0
        starts[:, 0] = True  # a row always begins a document
        if backend in ("sdpa", "flex"):
            doc_ids = starts.cumsum(dim=1)
            if backend == "flex":
                return cls(backend, block_mask=_document_block_mask(doc_ids))
            same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
            causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
            return cls(backend, mask=(same_doc & causal)[:, None])
        flat_starts = starts.flatten().nonzero().flatten()
        total = torch.tensor([rows * width], device=position_ids.device)
        cu_seqlens = torch.cat([flat_starts, total]).to(torch.int32)
        return cls(backend, cu_seqlens=cu_seqlens, max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))


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
    q, k, v = (t.reshape(rows * width, t.shape[2], dim) for t in (q, k, v))
    if docs.backend == "varlen":
        out = _varlen(q, k, v, docs, scale)
    elif docs.backend == "sdpa_docs":
        out = _per_document_sdpa(q, k, v, docs.cu_seqlens.tolist(), scale)
    else:
        raise ValueError(f"unknown attention backend {docs.backend!r}")
    return out.view(rows, width, heads, dim)


def _per_document_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qd, kd, vd = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True))
    return torch.cat([o[0].transpose(0, 1) for o in outs])


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocs, scale: float
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    extra = {}
    if q.shape[1] != k.shape[1]:
        if _varlen_supports_gqa():
            extra["enable_gqa"] = True
        else:  # older torch: repeat each KV head for its query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu, n = docs.cu_seqlens, docs.max_seqlen
    return varlen_attn(q, k, v, cu, cu, n, n, scale=scale, window_size=(-1, 0), **extra)


@functools.cache
def _varlen_supports_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _document_block_mask(doc_ids: torch.Tensor) -> object:
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    rows, width = doc_ids.shape
    return create_block_mask(
        same_document_causal, rows, None, width, width, device=doc_ids.device, _compile=doc_ids.is_cuda
    )


@functools.cache
def _compiled_flex() -> object:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_attention(*args: object, **kwargs: object) -> torch.Tensor:
    """flex_attention, compiled (eager flex materialises the scores; it is only a reference)."""
    return _compiled_flex()(*args, **kwargs)
