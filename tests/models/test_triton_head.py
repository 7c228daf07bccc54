"""The output head's one-pass Triton kernels, run by Triton's CPU interpreter against the torch
functions of chunked_head.py computed in float64."""

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = """
import torch
from tandem.models.layers import chunked_head, triton_head

gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
for dtype, vocab, temperature in [(torch.float32, 5000, 0.7), (torch.bfloat16, 4096, 1.0), (torch.float32, 37, 1.3)]:
    rows = 23
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[3, 11] = 40.0  # one dominant logit: the online max must rescale what came before
    logits[5, vocab - 2] = 40.0  # and one in the last block of columns
    logits[7, 0] = 40.0  # and one in the first column
    logits[9] = 2.5  # all equal: each step ties the running max
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    g_lp, g_ent = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    want = chunked_head.token_stats(logits.double(), targets, temperature)
    got = triton_head.token_stats(logits, targets, temperature)
    for name, a, b in zip(("logprob", "entropy", "lse"), got, want):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=name)
    lp, ent, lse = want
    grad_want = chunked_head.logit_grad(logits.double(), targets, lse, ent, g_lp, g_ent, temperature)
    buffer = logits.clone()
    grad = triton_head.logit_grad(buffer, targets, lse.float(), ent.float(), g_lp, g_ent, temperature)
    assert grad.data_ptr() == buffer.data_ptr() and grad.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad.double(), grad_want, atol=tol * grad_want.abs().max().item(), rtol=tol)
print("ok")
"""


def test_head_kernels_match_the_torch_functions_in_interpreter() -> None:
    run_interpreted(SCRIPT)
