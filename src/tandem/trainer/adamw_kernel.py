"""One Triton pass of AdamW over an fp32 master shard that also writes the model's parameter.

Per element it reads the gradient (bf16 or fp32), the fp32 master weight and the two moments,
and writes the master, the moments and the parameter in its own dtype. With fp32 moments that
is 14 bytes read and 14 written per element with a bf16 gradient and parameter (16 and 14 with
an fp32 gradient), the least any AdamW with fp32 state and a separate low-precision parameter
can move; with bf16 moments 10 and 10. The arithmetic is torch's AdamW (torch.optim.adamw,
single-tensor form) in fp32, its scalar coefficients computed on the host; the gradient is
first multiplied by `scale`, a 0-dim fp32 tensor on the device (the clipping coefficient, read
in the kernel so that clipping costs no pass of its own and no host synchronisation). bf16
moments are loaded into fp32 and stored rounded stochastically, with noise drawn from `seed`
and the element's offset (trainer/stochastic_round.py, which holds the same in torch). Tested
on CPU under TRITON_INTERPRET=1 against the torch form in trainer/master_weights.py.
"""

import torch
import triton
import triton.language as tl

from tandem.trainer.stochastic_round import HASH_MULTIPLIERS

BLOCK = 2048
HASH_A: tl.constexpr = tl.constexpr(HASH_MULTIPLIERS[0])
HASH_B: tl.constexpr = tl.constexpr(HASH_MULTIPLIERS[1])


@triton.jit
def _hash32(x):
    """stochastic_round.hash32 on uint32 (whose multiplication wraps modulo 2^32)."""
    x ^= x >> 16
    x *= HASH_A
    x ^= x >> 15
    x *= HASH_B
    x ^= x >> 16
    return x


@triton.jit
def _round_stochastic(x, bits):
    """stochastic_round.round_stochastic: fp32 `x` to bf16 with 16 random `bits` (uint32)."""
    pattern = x.to(tl.uint32, bitcast=True)
    rounded = ((pattern + bits) & 0xFFFF0000).to(tl.float32, bitcast=True)
    finite = (pattern & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, x).to(tl.bfloat16)  # exact: the low 16 bits are zero


@triton.jit(do_not_specialize=["seed"])
def _adamw_kernel(
    param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, scale_ptr, numel, seed,
    decay_factor, beta1_complement, beta2, beta2_complement, eps, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < numel
    grad = tl.load(grad_ptr + offsets, mask=valid).to(tl.float32) * tl.load(scale_ptr)
    weight = tl.load(master_ptr + offsets, mask=valid)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=valid).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=valid).to(tl.float32)
    weight = weight * decay_factor
    exp_avg = exp_avg + beta1_complement * (grad - exp_avg)  # torch's lerp (weight < 0.5)
    exp_avg_sq = exp_avg_sq * beta2 + beta2_complement * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    weight = weight - step_size * (exp_avg / denom)
    tl.store(master_ptr + offsets, weight, mask=valid)
    if STOCHASTIC:
        noise = _hash32(offsets.to(tl.uint32) ^ seed.to(tl.uint32))
        tl.store(exp_avg_ptr + offsets, _round_stochastic(exp_avg, noise & 0xFFFF), mask=valid)
        tl.store(exp_avg_sq_ptr + offsets, _round_stochastic(exp_avg_sq, noise >> 16), mask=valid)
    else:
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=valid)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=valid)
    tl.store(param_ptr + offsets, weight.to(param_ptr.dtype.element_ty), mask=valid)


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scale: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    seed: int = 0,
) -> None:
    """One AdamW step in place on contiguous tensors of equal numel (see the module docstring);
    `seed` (0 ≤ seed < 2^31) draws the rounding noise of bf16 moments."""
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moments must both be float32 or bfloat16, got {exp_avg.dtype}, {exp_avg_sq.dtype}")
    numel = master.numel()
    _adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        param, grad, master, exp_avg, exp_avg_sq, scale, numel, seed,
        1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, lr / (1 - beta1**step),
        (1 - beta2**step) ** 0.5,
        BLOCK=BLOCK, STOCHASTIC=exp_avg.dtype == torch.bfloat16,
    )  # fmt: skip
