"""Per-token logprobs and entropy of a causal LM, without materialising the full logits.

The output head turns N hidden states into N × V logits; in fp32 for a 150k vocabulary that is
600 kB per token, more than the rest of the activations. `chunked_logprobs` applies the head to
`chunk_size` tokens at a time, takes the fp32 log-softmax of that chunk, keeps only two numbers
per token (the target's logprob and the entropy) and drops the chunk. Its backward recomputes
each chunk's logits and forms the gradient directly:

    z = h Wᵀ / T,  p = softmax(z),  ℓ = log p[target],  H = −Σ p log p
    ∂ℓ/∂z = onehot(target) − p          ∂H/∂z = −p ⊙ (log p + H)

so peak memory is one chunk of logits in either direction.
"""

import torch


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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logp = chunk_log_softmax(hidden[start:end], weight, temperature)
            logprobs[start:end] = logp.gather(1, targets[start:end, None]).squeeze(1)
            entropy[start:end] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            logp = chunk_log_softmax(hidden[start:end], weight, ctx.temperature)
            p = logp.exp()
            g_lp = grad_logprobs[start:end, None].to(logp.dtype)
            g_ent = grad_entropy[start:end, None].to(logp.dtype)
            grad_z = -p * (g_lp + g_ent * (logp + entropy[start:end, None]))
            grad_z.scatter_add_(1, targets[start:end, None], g_lp)
            grad_z = (grad_z / ctx.temperature).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_z @ weight
            if grad_weight is not None:
                grad_weight += grad_z.T @ hidden[start:end]
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunk_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of one chunk's temperature-scaled logits: matmul in the weights' dtype, softmax in
    fp32 (or float64 for float64 weights)."""
    logits = (hidden @ weight.T).to(torch.promote_types(weight.dtype, torch.float32))
    return (logits / temperature).log_softmax(-1)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden Wᵀ / T)[target] and the entropy of that distribution, per row.

    `hidden` [..., H] and `targets` [...] are flattened; results have the shape of `targets`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute logprobs (got {temperature})")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")
    shape = targets.shape
    logprobs, entropy = ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), float(temperature), chunk_size
    )
    return logprobs.view(shape), entropy.view(shape)
