"""RMSNorm with transformers' order of rounding: normalise in fp32, cast back, then scale.

Scaling after the cast (not before) is what Qwen's reference does; keeping it bit-for-bit
makes the trainer's bf16 activations equal the engine's, which keeps the trainer–sampler
mismatch small.
"""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))  # at least fp32; fp64 stays fp64
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
