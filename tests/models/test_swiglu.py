"""SwiGLU's fused activation and down projection (layers/swiglu.py): the autograd function
against the plain form and float64 gradcheck on CPU, and its Triton kernels under Triton's CPU
interpreter against the torch reference forms."""

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from tandem.models.layers.swiglu import swiglu_down


def plain(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down.T


def test_fused_form_equals_the_plain_one() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    gate_up = torch.randn(2, 7, 2 * 24, generator=gen, requires_grad=True)
    w_down = torch.randn(16, 24, generator=gen, requires_grad=True)
    grad = torch.randn(2, 7, 16, generator=gen)
    results = []
    for form in (plain, swiglu_down):
        out = form(gate_up, w_down)
        out.backward(grad)
        results.append((out.detach(), gate_up.grad.clone(), w_down.grad.clone()))
        gate_up.grad = w_down.grad = None
    for name, got, want in zip(("out", "grad gate_up", "grad w_down"), *results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fused_form_under_activation_checkpointing(mode: str) -> None:
    """Recomputed in backward as the trainer's checkpointing does it (models/parallelism.py; the
    selective policy keeps the matmul inside the function): the same gradients as the plain form."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from tandem.models.parallelism import _keep_matmuls

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    w_gate_up = torch.randn(2 * 24, 16, generator=gen, requires_grad=True)
    w_down = torch.randn(16, 24, generator=gen, requires_grad=True)
    grad = torch.randn(3, 5, 16, generator=gen)
    context = {"context_fn": lambda: create_selective_checkpoint_contexts(_keep_matmuls)}
    results = []
    for form in (plain, swiglu_down):

        def block(inputs: torch.Tensor, form=form) -> torch.Tensor:
            return form(inputs @ w_gate_up.T, w_down)

        out = checkpoint(block, x, use_reentrant=False, **(context if mode == "selective" else {}))
        out.backward(grad)
        results.append([t.grad.clone() for t in (x, w_gate_up, w_down)])
        x.grad = w_gate_up.grad = w_down.grad = None
    for name, got, want in zip(("x", "w_gate_up", "w_down"), *results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 2 * 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w_down = torch.randn(4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_down, (gate_up, w_down))


SCRIPT = """
import torch
from tandem.models.layers import swiglu, triton_swiglu

gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
swiglu.BLOCK = triton_swiglu.BLOCK = 32  # several column blocks, the last one partly masked
for dtype, width in [(torch.float32, 80), (torch.bfloat16, 64)]:
    gate_up = (torch.randn(3, 5, 2 * width, generator=gen) * 3).to(dtype)
    grad_h = torch.randn(3, 5, width, generator=gen).to(dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    h = triton_swiglu.silu_mul(gate_up)
    assert h.dtype == dtype and h.shape == (3, 5, width)
    torch.testing.assert_close(h, swiglu.silu_mul(gate_up), **tol)
    got = triton_swiglu.silu_mul_backward(gate_up, grad_h)
    want = swiglu.silu_mul_backward(gate_up, grad_h)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)
print("ok")
"""


def test_kernels_match_the_torch_forms_in_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted(SCRIPT)
