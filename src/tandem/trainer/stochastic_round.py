"""Stochastic rounding of fp32 to bf16 with reproducible noise, for MasterAdamW's bf16 moments.

Why: AdamW's second moment moves by (1 − beta2) ≈ 0.1 % a step, below bf16's resolution
(2^-8 relative): rounded to nearest it would stop moving. Rounded stochastically — up with the
probability of the distance to the lower neighbour — every step's change survives on average,
E[round(x)] = x, so the moments follow their fp32 values.

The bit trick: add 16 random bits (0..65535) to x's 32-bit pattern and clear the low 16 bits.
IEEE floats are sign-magnitude with patterns ordered by magnitude, so this rounds the magnitude
up with probability (x's low 16 bits) / 2^16, for either sign and across exponent boundaries;
inf and nan are left as they are (a carry could turn a nan into an inf or wrap a negative nan).

The noise is a function of (seed, element offset) only, one 32-bit hash per element whose low
16 bits round exp_avg and high 16 bits exp_avg_sq: the Triton kernel (trainer/adamw_kernel.py,
in uint32, where multiplication wraps) and the torch form here (int64 masked to 32 bits, with
the multiplication split in 16-bit halves so no product overflows) give the same bits, which
tests/trainer/test_master_weights.py checks under TRITON_INTERPRET=1. The seed mixes the step
with a per-tensor key (its index in the optimizer and its shard's coordinates on the mesh), so
tensors and steps draw different noise while replicas of one shard draw the same (they stay
equal). Offsets are taken modulo 2^32: a shard's noise would repeat after 4 G elements.
"""

from typing import TypeVar

import torch

MASK32 = 0xFFFFFFFF
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)  # Chris Wellons' "lowbias32" integer hash

Int = TypeVar("Int", int, torch.Tensor)


def _mul32(x: Int, c: int) -> Int:
    """x · c mod 2^32 for 0 ≤ x < 2^32, without a product beyond 2^49 (int64 stays exact)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32(x: Int) -> Int:
    """A 32-bit mixing bijection of 0 ≤ x < 2^32 (Python ints, or int64 tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, HASH_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_MULTIPLIERS[1])
    return x ^ (x >> 16)


def noise_key(index: int, coordinates: list[int]) -> int:
    """A tensor's key for its noise: its index among the optimizer's parameters and its shard's
    coordinates on the mesh dimensions it is sharded on."""
    key = hash32(index & MASK32)
    for coordinate in coordinates:
        key = hash32((key + coordinate + 1) & MASK32)
    return key


def noise_seed(step: int, key: int) -> int:
    """The seed of a tensor's noise at `step`: 31 bits (a Triton int32 argument)."""
    return hash32((hash32(step & MASK32) ^ key) & MASK32) & 0x7FFFFFFF


def noise(seed: int, numel: int, device: torch.device) -> torch.Tensor:
    """Per element of a flat tensor, 32 random bits as int64: hash32((offset mod 2^32) ^ seed)."""
    offsets = torch.arange(numel, device=device, dtype=torch.int64) & MASK32
    return hash32(offsets ^ seed)


def round_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to bf16, up (in magnitude) with probability equal to the distance to the
    lower neighbour; `bits` (int64, 0 ≤ bits < 2^16, like x) is the noise. inf and nan stay."""
    pattern = x.view(torch.int32).to(torch.int64) & MASK32
    rounded = (pattern + bits) & 0xFFFF0000
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)
