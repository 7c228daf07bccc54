"""The launches around a decode step's FP8 matmuls, one by one, on one GPU: µs per call of each
elementwise kernel of a Qwen3-8B-shaped layer (kernels.py, triton_fp8.py) at M rows, plain and
in its fused FP8 form (fp8.py, "Fused launches"), and the row-kernels at 4 to 16 warps.

    python benchmarks/fp8_launches.py --rows 64 256

Each kernel is captured 50 times into a CUDA graph and replayed (no launch overhead, as in the
engine's decode graphs); its inputs are a few MB, so they sit in L2 as a decode step's
activations do. A layer's decode step runs 4 of them plain (bf16) and, with FP8 weights and the
fused launches, 5 (the attention output's quantizer added); separately, 4 quantizers and 4
scaling passes more.
"""

import argparse
import json
from collections.abc import Callable

import torch
import triton

from tandem.inference.engine import kernels
from tandem.inference.engine.fp8 import padded_rows
from tandem.inference.engine.triton_fp8 import _cold_us, quantize_rows, scale_outer_

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 12288  # Qwen3-8B


def graph_us(fn: Callable[[], object], calls: int = 50) -> float:
    """µs per call of `fn`, captured `calls` times into a CUDA graph and replayed (triton_fp8's
    timer: one call per "weight", here none)."""
    return _cold_us(lambda _: fn(), [None] * calls, repeats=10)


def launches(m: int) -> dict[str, float]:
    bf16, dev = torch.bfloat16, "cuda"
    pad = padded_rows(m)
    x = torch.randn(m, HIDDEN, dtype=bf16, device=dev)
    residual = torch.randn(m, HIDDEN, dtype=bf16, device=dev)
    weight = torch.rand(HIDDEN, dtype=bf16, device=dev) + 0.5
    row_s = torch.rand(pad, 1, device=dev) * 0.01
    hidden_s = torch.rand(1, HIDDEN, device=dev) * 0.01
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(m, qkv_width, dtype=bf16, device=dev)
    qkv_s = torch.rand(1, qkv_width, device=dev) * 0.01
    gate_up = torch.randn(m, 2 * INTER, dtype=bf16, device=dev)
    gate_up_s = torch.rand(1, 2 * INTER, device=dev) * 0.01
    attn_out = torch.randn(m, HEADS * HEAD_DIM, dtype=bf16, device=dev)
    down_in = torch.randn(m, INTER, dtype=bf16, device=dev)
    norms = [torch.rand(HEAD_DIM, dtype=bf16, device=dev) + 0.5 for _ in range(2)]
    cos, sin = torch.randn(2, 4096, HEAD_DIM, device=dev)
    positions = torch.randint(0, 4096, (m,), device=dev)
    caches = [torch.zeros(m // 16 + 1, 16, KV_HEADS, HEAD_DIM, dtype=bf16, device=dev) for _ in range(2)]
    slots = torch.randperm(16 * (m // 16 + 1), device=dev)[:m]
    qk = (HEADS, KV_HEADS, HEAD_DIM, *norms, 1e-6, cos, sin, positions, *caches, slots)
    out = {
        "rms_norm (bf16)": graph_us(lambda: kernels.rms_norm(x, weight, 1e-6, residual)),
        "rms_norm, scaled in, e4m3 out": graph_us(
            lambda: kernels.rms_norm(x, weight, 1e-6, residual, (row_s, hidden_s), pad)
        ),
        "qk_norm_rope (bf16)": graph_us(lambda: kernels.qk_norm_rope_store(qkv, *qk)),
        "qk_norm_rope, scaled in": graph_us(lambda: kernels.qk_norm_rope_store(qkv, *qk, (row_s, qkv_s))),
        "silu_mul (bf16)": graph_us(lambda: kernels.silu_mul(gate_up)),
        "silu_mul, scaled in, e4m3 out": graph_us(
            lambda: kernels.silu_mul_quantized(gate_up, pad, (row_s, gate_up_s))
        ),
        "quantize_rows K=4096 (o's input)": graph_us(lambda: quantize_rows(attn_out, pad)),
        "quantize_rows K=12288": graph_us(lambda: quantize_rows(down_in, pad)),
        "scale_outer_ N=6144 (qkv)": graph_us(lambda: scale_outer_(qkv, row_s, qkv_s)),
        "scale_outer_ N=24576 (gate_up)": graph_us(lambda: scale_outer_(gate_up, row_s, gate_up_s)),
        "scale_outer_ N=4096 (o, down)": graph_us(lambda: scale_outer_(x, row_s, hidden_s)),
    }
    q = torch.empty(pad, HIDDEN, dtype=torch.float8_e4m3fn, device=dev)
    qs = torch.empty(pad, 1, device=dev)
    res_out = torch.empty_like(x)
    block = triton.next_power_of_2(HIDDEN)
    for warps in (4, 8, 16):
        out[f"rms_norm, scaled in, e4m3 out, {warps} warps"] = graph_us(
            lambda w=warps: kernels._rms_norm_kernel[(pad,)](
                x,
                residual,
                weight,
                q,
                res_out,
                row_s,
                hidden_s,
                q,
                qs,
                m,
                1e-6,
                N=HIDDEN,
                BLOCK=block,
                HAS_RESIDUAL=True,
                X_SCALED=True,
                QUANT=True,
                num_warps=w,
            )  # fmt: skip
        )
    q2 = torch.empty(pad, INTER, dtype=torch.float8_e4m3fn, device=dev)
    for warps in (4, 8, 16, 32):
        out[f"silu_mul, scaled in, e4m3 out, {warps} warps"] = graph_us(
            lambda w=warps: kernels._silu_mul_quant_kernel[(pad,)](
                gate_up,
                row_s,
                gate_up_s,
                q2,
                qs,
                m,
                INTER,
                BLOCK=triton.next_power_of_2(INTER),
                X_SCALED=True,
                num_warps=w,
            )  # fmt: skip
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    table = {m: launches(m) for m in args.rows}
    print(json.dumps({str(m): t for m, t in table.items()}))
    print(f"\nµs per call on {torch.cuda.get_device_name()} (Qwen3-8B layer shapes)")
    print("| kernel | " + " | ".join(f"M = {m}" for m in args.rows) + " |")
    for name in table[args.rows[0]]:
        print(f"| {name} | " + " | ".join(f"{table[m][name]:.2f}" for m in args.rows) + " |")


if __name__ == "__main__":
    main()
