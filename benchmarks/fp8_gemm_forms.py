"""cuBLAS's unit-scaled FP8 product at decode row counts, in the forms `torch._scaled_mm` offers,
against the bf16 matmul: which streams FP8 weights closest to the memory's bandwidth.

    python benchmarks/fp8_gemm_forms.py --rows 16 64 128 256

The engine's row-wise FP8 path (fp8.py) takes x·Wᵀ with unit scales up to 256 rows and applies
the scales after it. At 64 rows that product reads the weights of a Qwen3-8B-shaped layer at
~3 TB/s (docs/benchmarks.md, issue 11), where FP8 decode at 64 concurrent requests needs ~4 TB/s
to reach 1.5× bf16. Forms timed here, per layer shape [N × K] and row count M:

- `x·Wᵀ`: what the engine runs (A = the e4m3 activations [M, K], B = the weight's transpose);
- `x·Wᵀ fast`: the same with `use_fast_accum=True` (no periodic promotion of Hopper's FP8
  accumulator: faster where compute matters, less exact over long K);
- `W·xᵀ`: the product transposed ("swap AB": A = the weight [N, K], so the long N dimension
  fills the kernel's M tiles and the few rows its N tiles); the engine would read the [N, M]
  result through a transposed view;
- `W·xᵀ fast`: both.

Beside them, `read`: a Triton kernel that only reads the same e4m3 bytes (many programs, each a
contiguous run), the bound of any kernel that streams this weight once from memory.

Each form runs once per weight copy (more bytes than L2, so every call reads its weight from
memory), captured in a CUDA graph and replayed (triton_fp8._cold_us, the engine's decode
setting). TB/s = the weight's bytes / time; "err" = the relative error of the form's product
against the fp32 product of the same e4m3 values.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem.inference.engine.triton_fp8 import _cold_us

L2_FLUSH_BYTES = 256 * 2**20  # more than the H200's L2 (50 MB)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # Qwen3-8B


# (words a block, blocks a program, warps): the fastest on an H100 were the first two (2026-12-07)
READ_CONFIGS = [(1024, 4, 8), (1024, 16, 8), (2048, 4, 8), (4096, 4, 8)]


@triton.jit
def _read_kernel(words_ptr, out_ptr, numel, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    # each program xors BLOCKS consecutive blocks of int32 words into one word (kept: the loads stay)
    base = tl.program_id(0).to(tl.int64) * BLOCK * BLOCKS
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.range(0, BLOCKS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(words_ptr + offs, mask=offs < numel, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def read_us(weights: list[torch.Tensor]) -> float:
    """µs to only read one weight copy from memory, the fastest of READ_CONFIGS."""
    words = [w.view(torch.int32).view(-1) for w in weights]
    out = torch.empty(words[0].numel() // 1024 + 1, dtype=torch.int32, device=words[0].device)

    def read(w: torch.Tensor, block: int, blocks: int, warps: int) -> None:
        grid = (triton.cdiv(w.numel(), block * blocks),)
        _read_kernel[grid](w, out, w.numel(), BLOCK=block, BLOCKS=blocks, num_warps=warps)

    return min(_cold_us(lambda w, c=config: read(w, *c), words) for config in READ_CONFIGS)


def forms(x: torch.Tensor, one: torch.Tensor) -> dict:
    """name → fn(weight e4m3 [N, K]) → the product (either orientation)."""

    def mm(a: torch.Tensor, b: torch.Tensor, fast: bool) -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)

    return {
        "x·Wᵀ": lambda w: mm(x, w.t(), False),
        "x·Wᵀ fast": lambda w: mm(x, w.t(), True),
        "W·xᵀ": lambda w: mm(w, x.t(), False),
        "W·xᵀ fast": lambda w: mm(w, x.t(), True),
    }


def measure(name: str, n: int, k: int, m: int, generator: torch.Generator) -> dict:
    copies = max(2, -(-L2_FLUSH_BYTES // (n * k)))
    weights = [
        (torch.randn(n, k, device="cuda", generator=generator) * 0.05).to(torch.float8_e4m3fn)
        for _ in range(copies)
    ]
    bf16 = [w.to(torch.bfloat16) for w in weights[: max(2, copies // 2)]]  # as many bytes: half the copies
    x = (torch.randn(m, k, device="cuda", generator=generator)).to(torch.float8_e4m3fn)
    xb = x.to(torch.bfloat16)
    one = torch.ones((), device="cuda")
    want = x.float() @ weights[0].float().t()
    row = {
        "layer": name,
        "N": n,
        "K": k,
        "M": m,
        "bf16_us": _cold_us(lambda w: F.linear(xb, w), bf16),
        "read_us": read_us(weights),
    }
    for form, fn in forms(x, one).items():
        try:
            got = fn(weights[0]).float()
            got = got.t() if form.startswith("W") else got
            row[f"{form}_err"] = float((got - want).norm() / want.norm())
            row[f"{form}_us"] = _cold_us(fn, weights)
        except Exception as e:  # a form this torch or cuBLAS refuses: say so, keep going
            row[f"{form}_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with FP8 tensor cores (SM89+)")
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        for m in args.rows:
            rows.append(measure(name, n, k, m, generator))
            print(json.dumps(rows[-1]), flush=True)
    names = list(forms(torch.empty(0), torch.empty(0)))
    print(f"\nµs per call (TB/s of weight bytes) on {torch.cuda.get_device_name()}, Qwen3-8B layer shapes")
    print("| layer | M | bf16 | read (bound) | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for r in rows:
        weight_bytes = r["N"] * r["K"]
        cells = [
            f"{r['bf16_us']:.1f} ({2 * weight_bytes / r['bf16_us'] / 1e6:.2f})",
            f"{r['read_us']:.1f} ({weight_bytes / r['read_us'] / 1e6:.2f})",
        ]
        for form in names:
            us = r.get(f"{form}_us")
            cells.append(
                "failed"
                if us is None
                else f"{us:.1f} ({weight_bytes / us / 1e6:.2f}; err {r[f'{form}_err']:.0e})"
            )
        print(f"| {r['layer']} | {r['M']} | " + " | ".join(cells) + " |")
    total = {form: {} for form in ["bf16", "read", *names]}
    for r in rows:
        for form in total:
            us = r.get(f"{form}_us")
            if us is not None:
                total[form][r["M"]] = total[form].get(r["M"], 0.0) + us
    print("\nA whole layer (qkv + o + gate_up + down), µs: " + json.dumps(total))


if __name__ == "__main__":
    main()
