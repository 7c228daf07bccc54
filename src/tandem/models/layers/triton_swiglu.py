"""The Triton kernels of layers/swiglu.py (CUDA; tested on CPU under TRITON_INTERPRET=1).

Each program takes BLOCK columns of one row: the gate's at [row, c], the up's at [row, H + c].
"""

import torch
import triton
import triton.language as tl

from tandem.models.layers.swiglu import BLOCK


@triton.jit
def _forward_kernel(gate_up_ptr, h_ptr, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < H
    gate = tl.load(gate_up_ptr + row * 2 * H + cols, mask=inside).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * H + H + cols, mask=inside).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + row * H + cols, h.to(h_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward_kernel(gate_up_ptr, grad_h_ptr, grad_gate_up_ptr, h_ptr, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < H
    gate = tl.load(gate_up_ptr + row * 2 * H + cols, mask=inside).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * H + H + cols, mask=inside).to(tl.float32)
    grad = tl.load(grad_h_ptr + row * H + cols, mask=inside).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
    out = grad_gate_up_ptr.dtype.element_ty
    tl.store(grad_gate_up_ptr + row * 2 * H + cols, grad_gate.to(out), mask=inside)
    tl.store(grad_gate_up_ptr + row * 2 * H + H + cols, (grad * silu).to(out), mask=inside)
    tl.store(h_ptr + row * H + cols, (silu * up).to(h_ptr.dtype.element_ty), mask=inside)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    width = rows.shape[1] // 2
    h = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        _forward_kernel[(rows.shape[0], triton.cdiv(width, BLOCK))](rows, h, width, BLOCK=BLOCK, num_warps=4)
    return h.view(*gate_up.shape[:-1], width)


def silu_mul_backward(gate_up: torch.Tensor, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, grad = _rows(gate_up), _rows(grad_h.contiguous())
    width = rows.shape[1] // 2
    grad_gate_up = torch.empty_like(rows)
    h = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(width, BLOCK))
        _backward_kernel[grid](rows, grad, grad_gate_up, h, width, BLOCK=BLOCK, num_warps=4)
    return grad_gate_up.view(gate_up.shape), h.view(*gate_up.shape[:-1], width)
