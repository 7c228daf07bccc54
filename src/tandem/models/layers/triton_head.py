"""One-pass Triton kernels for the chunked output head's per-chunk arithmetic (chunked_head.py).

`token_stats` reads a chunk's logits [rows, V] once and returns per row, in fp32, the target's
logprob, the entropy and the logsumexp of z = logits / T. Each program walks one row keeping,
lane by lane, an online softmax: the running max m, s = Σ exp(z − m) and t = Σ exp(z − m)·z,
rescaled whenever m grows; the lanes are combined at the end, so

    lse = M + log S,   H = lse − T / S,   log p[target] = z[target] − lse.

`logit_grad` reads the logits once more and writes ∂(g_ℓ·ℓ + g_H·H)/∂logits in their place
(same formula as chunked_head.logit_grad): the chunk's logits are dead after it, so the
backward needs no second chunk-sized buffer. Both take the logits in their own dtype (bf16 on
the training path) and do the arithmetic in fp32. Tested on CPU under TRITON_INTERPRET=1
against the torch functions of chunked_head.py.
"""

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary columns per iteration of one program


@triton.jit
def _stats_kernel(
    logits_ptr, stride, targets_ptr, inv_temp, vocab,
    logprob_ptr, entropy_ptr, lse_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    m = tl.full((BLOCK,), -1e30, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    t = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + e
        t = t * scale + tl.where(valid, e * z, 0.0)
        m = m_new
    big = tl.max(m, 0)
    weight = tl.exp(m - big)
    total = tl.sum(s * weight, 0)
    lse = big + tl.log(total)
    entropy = lse - tl.sum(t * weight, 0) / total
    target = tl.load(targets_ptr + row)
    z_target = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(logprob_ptr + row, z_target - lse)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _grad_kernel(
    logits_ptr, stride, targets_ptr, lse_ptr, entropy_ptr, g_lp_ptr, g_ent_ptr, inv_temp, vocab,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_lp = tl.load(g_lp_ptr + row).to(tl.float32)
    g_ent = tl.load(g_ent_ptr + row).to(tl.float32)
    target = tl.load(targets_ptr + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        logp = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp - lse
        grad = -tl.exp(logp) * (g_lp + g_ent * (logp + entropy))
        grad = tl.where(cols == target, grad + g_lp, grad) * inv_temp
        tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=valid)


def token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p[target], entropy, logsumexp) per row of one chunk's logits [rows, V], in fp32."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the head kernels read rows of contiguous logits"
    out = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)]
    if rows:
        _stats_kernel[(rows,)](
            logits, logits.stride(0), targets, 1.0 / temperature, vocab, *out, BLOCK=BLOCK, num_warps=8
        )
    return out[0], out[1], out[2]


def logit_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """The logit gradient of one chunk, written over `logits` (which is returned)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the head kernels read rows of contiguous logits"
    if rows:
        _grad_kernel[(rows,)](
            logits, logits.stride(0), targets, lse, entropy, grad_logprobs.contiguous(),
            grad_entropy.contiguous(), 1.0 / temperature, vocab, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
    return logits
