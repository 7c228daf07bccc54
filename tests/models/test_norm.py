"""RMSNorm's fused form (layers/norm.py): the residual addition and the norm against the torch
reference forms — the autograd function's forward and gradients, and its Triton kernels under
Triton's CPU interpreter (the function itself runs on CUDA only: tests/gpu)."""

import pytest
from triton_interpreter import run_interpreted

SCRIPT = """
import torch
from tandem.models.layers import norm, triton_norm

gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
triton_norm.MAX_PROGRAMS = 4  # several rows a program, the last program's block partly empty
for dtype, w_dtype, dim in [(torch.float32, torch.float32, 48), (torch.bfloat16, torch.bfloat16, 64),
                            (torch.bfloat16, torch.float32, 40)]:
    x = (torch.randn(3, 5, dim, generator=gen) * 2).to(dtype)
    delta = torch.randn(3, 5, dim, generator=gen).to(dtype)
    w = (1 + torch.randn(dim, generator=gen) / 4).to(w_dtype)
    grad_out = torch.randn(3, 5, dim, generator=gen).to(torch.promote_types(dtype, w_dtype))
    grad_s = torch.randn(3, 5, dim, generator=gen).to(dtype)
    eps = 1e-6
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for with_delta in (False, True):
        s, out, rstd = triton_norm.forward(x, delta if with_delta else None, w, eps)
        want_s = x + delta if with_delta else x
        torch.testing.assert_close(s, want_s, **tol)  # (the interpreter's casts to bf16 truncate)
        want = norm.rms_norm(want_s, w, eps)
        assert out.dtype == want.dtype and out.shape == want.shape
        torch.testing.assert_close(out, want, **tol)
        # the gradients autograd takes through the reference form, in float64
        xs = want_s.double().requires_grad_()
        ws = w.double().requires_grad_()
        ref = norm.rms_norm(xs, ws, eps)
        ref.backward(grad_out.double())
        grad_x, grad_w = triton_norm.backward(grad_out, grad_s if with_delta else None, s, w, rstd)
        want_grad_x = xs.grad + (grad_s.double() if with_delta else 0)
        assert grad_x.dtype == dtype and grad_w.dtype == w_dtype
        torch.testing.assert_close(grad_x.double(), want_grad_x, **tol)
        torch.testing.assert_close(grad_w.double(), ws.grad, **tol)
print("ok")
"""


def test_kernels_match_the_reference_in_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted(SCRIPT)
