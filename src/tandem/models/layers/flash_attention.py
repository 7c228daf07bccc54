"""Causal attention over packed documents with FlashAttention 4's kernels (`model.attention = "flash"`).

FlashAttention 4 (the `flash-attn-4` package, imported as `flash_attn.cute`) writes its kernels
in NVIDIA's CuTe DSL and compiles them at first use for the GPU at hand: on Hopper (SM90) they
are FlashAttention 3's design (warp-specialised, TMA loads, wgmma), which none of torch 2.11's
own attention kernels are. Its variable-length entry takes the packed tokens [T, heads, d] with
int32 `cu_seqlens` and grouped-query heads as they are, causal aligned at the bottom right when a
segment has fewer queries than keys (ring context parallelism), as the other varlen backends.

The package's autograd function is plain Python around JIT-compiled kernels, which dynamo
would trace into from a compiled block. So the forward and backward are registered here as
custom operators (`tandem::flash_varlen_fwd` / `_bwd`), opaque to the compiler and to selective
checkpointing (models/parallelism.py lists the forward). The backward calls the package's
`_flash_attn_bwd`, the function its own autograd function calls: not a public name, so a new
package version may move it (the GPU tests would fail, not the results silently change).

The package is optional (CUDA only; `pip install flash-attn-4`, which brings the CuTe DSL, ~100 MB):
`model.attention = "flash"` says at start when it is missing. Its kernels are compiled per
head size, dtype and GQA ratio, not per length (the length bound is rounded up as cudnn's:
cudnn_attention.rounded_lengths), so changing batches do not recompile them
(a new batch's first call: 4 ms on an H100). There its kernels take cuDNN's time and its host
work, ~1 ms a layer's forward and backward, is felt on RL's small layers (docs/trainer.md).
"""

import functools
import importlib

import torch

INSTALL = "pip install flash-attn-4"


def require_flash_attention() -> None:
    """Raise a one-line error when FlashAttention 4 cannot be imported."""
    try:
        _interface()
    except ImportError as e:
        raise ValueError(f"model.attention = 'flash' needs FlashAttention 4: {INSTALL} ({e})") from None


@functools.cache
def _interface():  # noqa: ANN202 (the package's module)
    return importlib.import_module("flash_attn.cute.interface")


@torch.library.custom_op("tandem::flash_varlen_fwd", mutates_args=())
def flash_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [T, heads, d] and log-sum-exp [heads, T] (fp32, what the backward reads)."""
    out, lse, *_ = _interface()._flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        return_lse=True,
    )
    return out, lse


@flash_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):  # noqa: ANN001, ANN202
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tandem::flash_varlen_bwd", mutates_args=())
def flash_varlen_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(
        q,
        k,
        v,
        out,
        grad_out,
        lse,
        scale,
        True,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    return dq, dk, dv


@flash_varlen_bwd.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):  # noqa: ANN001, ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.lengths, ctx.scale = (max_seqlen_q, max_seqlen_k), scale


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):  # noqa: ANN001, ANN202
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = flash_varlen_bwd(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, ctx.scale
    )
    return dq, dk, dv, None, None, None, None, None


flash_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_causal(
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
    [T_k, kv_heads, d], int32 offsets; keys segmented as the queries unless their own offsets
    are given (then a segment with fewer queries than keys holds the last queries of its keys)."""
    own_keys = cu_seqlens_k is not None
    out, _ = flash_varlen_fwd(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens_k if own_keys else cu_seqlens,
        max_seqlen,
        max_seqlen_k if own_keys else max_seqlen,
        scale,
    )
    return out
