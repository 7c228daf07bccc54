"""The CUDA decode kernel, run by Triton's CPU interpreter against the gather + SDPA path."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = """
import torch
from tandem.inference.engine.attention import decode_attention
from tandem.inference.engine.triton_decode import paged_decode_attention

torch.manual_seed(0)
for kv_heads, heads, dim in [(2, 4, 64), (8, 16, 128), (4, 4, 32)]:
    k_cache, v_cache = torch.randn(2, 40, 16, kv_heads, dim).unbind(0)
    q = torch.randn(3, heads, dim)
    tables = torch.tensor([[5, 9, 3, 0, 0], [1, 2, 0, 0, 0], [7, 8, 10, 11, 30]])
    lens = torch.tensor([40, 17, 80])
    ref = decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    err = (out - ref).abs().max().item()
    assert err < 1e-5, (kv_heads, heads, dim, err)
print("ok")
"""


def test_decode_kernel_matches_gather_path_in_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
