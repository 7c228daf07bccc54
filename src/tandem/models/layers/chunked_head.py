"""Per-token logprobs and entropy of a causal LM, without materialising the full logits.

The output head turns N hidden states into N × V logits; in fp32 for a 150k vocabulary that is
600 kB per token, more than the rest of the activations. `chunked_logprobs` applies the head to
`chunk_size` tokens at a time, reduces that chunk's fp32 softmax to three numbers per token (the
target's logprob, the entropy and the logsumexp) and drops the chunk. Its backward recomputes
each chunk's logits and forms the gradient directly, elementwise given the saved logsumexp:

    z = h Wᵀ / T,  p = softmax(z),  ℓ = log p[target],  H = −Σ p log p
    ∂ℓ/∂z = onehot(target) − p          ∂H/∂z = −p ⊙ (log p + H)

so peak memory is one chunk of logits in either direction; each chunk's weight gradient is
added into an fp32 sum (on CUDA inside the matmul, torch's `out_dtype` addmm, where torch has it).
With `keep_logits` the forward writes every chunk's logits into one buffer (tokens × vocabulary in
the logits' dtype: 5 GB for 16,384 tokens of a 152k vocabulary in bf16) and the backward turns
them into the logit gradient in place, then takes both input gradients with one matmul each over
all the tokens: one of the head's four matmuls less, no per-chunk sum, and the weight gradient
accumulated in the matmul's fp32 over every token before its one rounding. On CUDA each
direction's per-chunk arithmetic is one Triton kernel that reads the chunk's logits once
(triton_head.py), and the backward writes the logit gradient over the (recomputed or kept)
logits. Measured on one H200 for a chunk of 4,096 × 151,936 bf16 logits
(benchmarks/head_kernels.py): 0.58 + 0.71 ms against 2.48 + 3.14 ms for the same functions under
torch.compile (the statistics kernel then took two exponentials per logit; with one, ~10 % less
on an H100: triton_head.py).
"""

from collections.abc import Callable

import torch


def token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p[target], entropy, logsumexp) per row of one chunk's logits, in fp32 (or wider)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = z.logsumexp(-1)
    p = (z - lse[:, None]).exp()
    entropy = lse - (p * z).sum(-1)
    return z.gather(1, targets[:, None]).squeeze(1) - lse, entropy, lse


def logit_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """∂(g_ℓ·ℓ + g_H·H)/∂logits for one chunk, in the logits' dtype (see the module docstring)."""
    z = logits.to(lse.dtype) / temperature
    logp = z - lse[:, None]
    p = logp.exp()
    g_lp, g_ent = grad_logprobs[:, None].to(lse.dtype), grad_entropy[:, None].to(lse.dtype)
    grad_z = -p * (g_lp + g_ent * (logp + entropy[:, None]))
    grad_z = grad_z.scatter_add(1, targets[:, None], g_lp)
    return (grad_z / temperature).to(logits.dtype)


def default_chunk_size(device: torch.device) -> int:
    """Tokens per chunk when the caller sets none: 4096 on CUDA (fewer, larger kernels; a chunk of
    a 152k vocabulary is 1.2 GB of bf16 logits), 1024 elsewhere (the fp32 path keeps ~3 copies)."""
    return 4096 if device.type == "cuda" else 1024


def _kernels(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[Callable, Callable]:
    """(token_stats, logit_grad) for the chunks of hidden Wᵀ: the one-pass Triton kernels on CUDA
    (bf16, fp16 or fp32 logits), the torch functions above elsewhere."""
    if hidden.device.type != "cuda" or torch.promote_types(hidden.dtype, weight.dtype) == torch.float64:
        return token_stats, logit_grad
    from tandem.models.layers import triton_head

    return triton_head.token_stats, triton_head.logit_grad


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) → (logprobs [N], entropy [N]), fp32 or wider."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        keep_logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        logprobs, entropy, lse = (torch.empty(n, dtype=dtype, device=hidden.device) for _ in range(3))
        stats = _kernels(hidden, weight)[0]
        kept = None
        if keep_logits:
            logits_dtype = torch.promote_types(hidden.dtype, weight.dtype)
            kept = torch.empty(n, weight.shape[0], dtype=logits_dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            if kept is None:
                logits = hidden[start:end] @ weight.T
            else:
                logits = torch.matmul(hidden[start:end], weight.T, out=kept[start:end])
            logprobs[start:end], entropy[start:end], lse[start:end] = stats(
                logits, targets[start:end], temperature
            )
        ctx.save_for_backward(hidden, weight, targets, entropy, lse)
        ctx.temperature, ctx.chunk_size, ctx.kept = temperature, chunk_size, kept
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        hidden, weight, targets, entropy, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gradient = _kernels(hidden, weight)[1]
        kept, ctx.kept = ctx.kept, None  # used once: overwritten below (a second backward recomputes)
        n = hidden.shape[0]

        def logit_grad(logits: torch.Tensor, rows: slice) -> torch.Tensor:
            return gradient(
                logits, targets[rows], lse[rows], entropy[rows], grad_logprobs[rows], grad_entropy[rows],
                ctx.temperature,
            )  # fmt: skip

        if kept is not None:
            for start in range(0, n, ctx.chunk_size):
                rows = slice(start, min(start + ctx.chunk_size, n))
                chunk = kept[rows]
                grad_z = logit_grad(chunk, rows)  # in place (the Triton kernel) or a new tensor (torch)
                if grad_z.data_ptr() != chunk.data_ptr():
                    chunk.copy_(grad_z)
            grad_hidden = kept @ weight if need_hidden else None
            grad_weight = (kept.T @ hidden).to(weight.dtype) if need_weight else None
            return grad_hidden, grad_weight, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        )
        for start in range(0, n, ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, n))
            grad_z = logit_grad(hidden[rows] @ weight.T, rows)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ weight
            if grad_weight is not None:
                _add_product(grad_weight, grad_z.T, hidden[rows])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, `total` in fp32 and a, b maybe narrower: inside the matmul (its epilogue adds
    into fp32) on CUDA, else a product in a, b's dtype and then an add."""
    if total.is_cuda and total.dtype != a.dtype and hasattr(torch.ops.aten.addmm, "dtype_out"):
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total += a @ b


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden Wᵀ / T)[target] and the entropy of that distribution, per row.

    `hidden` [..., H] and `targets` [...] are flattened; results have the shape of `targets`.
    `keep_logits`: the backward reads the forward's logits instead of recomputing them (module
    docstring); the same result, one matmul less, the logits' memory held until the backward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute logprobs (got {temperature})")
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.device)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")
    shape = targets.shape
    keep_logits = keep_logits and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logprobs, entropy = ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        float(temperature),
        chunk_size,
        keep_logits,
    )
    return logprobs.view(shape), entropy.view(shape)


def next_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the final hidden states [rows, width, H] of `input_ids` [rows, width]: the logprob of
    every token given those before it and the entropy there, [rows, width], aligned with the
    tokens (entry t predicts token t from positions < t; column 0 has no prediction and is 0)."""
    logprobs, entropy = chunked_logprobs(
        hidden[:, :-1], weight, input_ids[:, 1:], temperature, chunk_size, keep_logits
    )
    zero = logprobs.new_zeros(logprobs.shape[0], 1)
    return torch.cat([zero, logprobs], 1), torch.cat([zero, entropy], 1)
