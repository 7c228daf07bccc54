"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), gate and up as one matmul.

On CUDA the activation and the down projection run as one autograd function with one-pass
kernels each way (layers/swiglu.py) when `w_down` is a plain Linear (not one LoRA wraps)."""

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers.swiglu import swiglu_down


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.w_gate_up = nn.Linear(dim, 2 * hidden_dim, bias=False)  # [gate; up] rows
        self.w_down = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)
        if gate_up.is_cuda and type(self.w_down) is nn.Linear and self.w_down.bias is None:
            return swiglu_down(gate_up, self.w_down.weight)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)
