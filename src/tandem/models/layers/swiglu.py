"""SwiGLU's activation and down projection as one autograd function: down(silu(g) · u).

What torch.compile makes of `w_down(silu(gate) * up)` on an H200 (benchmarks.md, seventh
session): the product h is not saved but recomputed in the backward (one pass over gate and up),
and the gradient of the `chunk` that splits gate from up is a `cat` whose one kernel reads gate
and the incoming gradient twice (473 µs at 16,384 × 6,144, ~3 TB/s of what it must move). Here
the forward writes h in one pass (Triton, reading gate and up once), the down projection keeps
only its inputs (gate_up and the weight, as before), and the backward recomputes h together with
the gradient of gate_up in one pass: read gate, up and ∂h, write ∂gate, ∂up and h.

    h = silu(g) · u,  silu(g) = g · σ(g)
    ∂g = ∂h · u · σ(g) · (1 + g · (1 − σ(g))),   ∂u = ∂h · silu(g)

gate_up is [..., 2H] with gate in its first H columns (layers/mlp.py). The arithmetic is fp32
(or wider) whatever the dtype. The kernels run on CUDA; the torch forms below are the reference (CPU, and
the interpreter tests in tests/models/test_swiglu.py).
"""

import torch
import torch.nn.functional as F

BLOCK = 1024  # columns per program


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) · up in fp32 (or wider), cast to gate_up's dtype (the reference form)."""
    gate, up = _wide(gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def silu_mul_backward(gate_up: torch.Tensor, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂gate_up, h) from gate_up and ∂h (the reference form)."""
    gate, up = _wide(gate_up).chunk(2, dim=-1)
    grad = _wide(grad_h)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
    grad_gate_up = torch.cat([grad_gate, grad * silu], dim=-1).to(gate_up.dtype)
    return grad_gate_up, (silu * up).to(gate_up.dtype)


def _kernels(gate_up: torch.Tensor) -> tuple:
    if gate_up.device.type != "cuda":
        return silu_mul, silu_mul_backward
    from tandem.models.layers import triton_swiglu

    return triton_swiglu.silu_mul, triton_swiglu.silu_mul_backward


class SwiGLUDown(torch.autograd.Function):
    """(gate_up [..., 2H], w_down [D, H]) → silu(gate) · up @ w_downᵀ [..., D]."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, gate_up: torch.Tensor, w_down: torch.Tensor
    ) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up, w_down)
        return _kernels(gate_up)[0](gate_up) @ w_down.T

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, w_down = ctx.saved_tensors
        grad_h = grad_out @ w_down
        grad_gate_up, h = _kernels(gate_up)[1](gate_up, grad_h)
        grad_w = grad_out.reshape(-1, grad_out.shape[-1]).T @ h.reshape(-1, h.shape[-1])
        return grad_gate_up, grad_w


def swiglu_down(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return SwiGLUDown.apply(gate_up, w_down)
