"""Causal attention over packed documents with cuDNN's own variable-length kernels.

cuDNN runs attention over ragged documents (the THD layout: tokens × heads × dim, keyed by
cu_seqlens) with its Hopper kernels, which torch 2.11 reaches only through a path that is
broken for packed documents (docs/benchmarks.md, seventh session). NVIDIA's cuDNN frontend
package (`nvidia-cudnn-frontend`, imported as `cudnn`) exposes the same kernels as the
differentiable operator `torch.ops.cudnn.sdpa_fwd`; this module calls it. The package is
optional: `model.attention = "cudnn"` says at start when it is missing.

The operator builds one cuDNN graph per number of documents and longest document (the backward's
also per token count) and caches it; a build selects and may compile kernels, not something for
every step. So the documents are padded to a power of two with empty ones (their offsets repeat
the last) and the longest length is rounded up to a power of two: the trainer's changing batches
then reuse a few graphs. Neither may change an output (each document is bounded by its own
length; the GPU tests check it), and neither costs GPU time (H200, 2026-12-05: the kernels of a
layer's forward and backward 1.066 ms padded against 1.060 exact; benchmarks.md).

The operator's own host work (in Python, ~2.2 ms per forward and backward there) exceeds its
kernels' time on small batches: it pays where documents are long (SFT), not on RL micro-batches.
"""

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.models.layers.attention import PackedDocs

MIN_DOCUMENTS = 8
MIN_LENGTH = 128


def require_cudnn_frontend() -> None:
    """Raise a one-line error when the cuDNN frontend package cannot be imported."""
    try:
        _register_operator()
    except ImportError as e:
        raise ValueError(
            "model.attention = 'cudnn' needs NVIDIA's cuDNN frontend: pip install nvidia-cudnn-frontend "
            f"({e})"
        ) from None


@functools.cache
def _register_operator() -> None:
    import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers torch.ops.cudnn.sdpa_fwd and its backward)


def cudnn_buckets(docs: "PackedDocs") -> dict:
    """`docs`' offsets padded to a power of two of documents (at least MIN_DOCUMENTS) with empty
    ones, and its longest lengths rounded up (`rounded_lengths`), as PackedDocs fields. Registers
    the operator on first use. Runs where PackedDocs is built, outside compiled code (it reads
    lengths on the host)."""
    require_cudnn_frontend()
    documents = _bucket(len(docs.cu_seqlens) - 1, MIN_DOCUMENTS)
    fields = {"cu_seqlens": _pad_documents(docs.cu_seqlens, documents), **rounded_lengths(docs)}
    if docs.cu_seqlens_k is not None:  # keys of their own (ring context parallelism)
        fields["cu_seqlens_k"] = _pad_documents(docs.cu_seqlens_k, documents)
    return fields


def rounded_lengths(docs: "PackedDocs") -> dict:
    """`docs`' longest lengths (queries, and keys where they have their own offsets) rounded up to
    a power of two, at least MIN_LENGTH, as PackedDocs fields: a bound that changes no value, and
    takes few values, so that compiled blocks (which see it as a constant) and cached kernel
    graphs serve changing batches. Also flash's bounds (layers/flash_attention.py)."""
    fields = {"max_seqlen": _bucket(docs.max_seqlen, MIN_LENGTH)}
    if docs.cu_seqlens_k is not None:
        fields["max_seqlen_k"] = _bucket(docs.max_seqlen_k, MIN_LENGTH)
    return fields


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _pad_documents(cu_seqlens: torch.Tensor, documents: int) -> torch.Tensor:
    """Offsets [n + 1] → [documents + 1]: empty documents after the last."""
    missing = documents + 1 - len(cu_seqlens)
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(missing)]) if missing else cu_seqlens


def cudnn_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """Causal attention of each segment of the flattened rows: q [T, heads, d], k and v
    [T_k, kv_heads, d] (grouped-query heads taken as they are), int32 offsets (as `cudnn_buckets`
    gives them: one graph serves every batch of the same buckets). Keys are segmented as the
    queries unless their own offsets are given; a segment with fewer queries than keys holds the
    last queries of its keys (causal aligned at the bottom right)."""
    own_keys = cu_seqlens_k is not None
    out, _ = torch.ops.cudnn.sdpa_fwd(
        q,
        k,
        v,
        scale,
        is_causal=True,
        causal_bottom_right=own_keys,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens_k if own_keys else cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen_k if own_keys else max_seqlen,
        return_lse=True,  # the backward reads the forward's log-sum-exp
    )
    return out
