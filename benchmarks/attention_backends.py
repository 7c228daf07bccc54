"""The trainer's packed-attention backends alone, side by side on one GPU.

    python benchmarks/attention_backends.py                       # every backend, both batches
    python benchmarks/attention_backends.py --backends flex,cudnn --batches mfu --heads 32:4

Forward + backward of one layer's causal attention (layers/attention.py `packed_attention`,
bf16, `--heads` query:KV heads of 128; 16:8 is Qwen3-0.6B's and 1.7B's, 32:4 the 30B-A3B's)
over the documents of a packed micro-batch:

- `mfu`: trainer_mfu.py's batch, 4 rows × 4,096 tokens of documents of 256–2,304 tokens;
- `rl`: an RL micro-batch, 4 rows × 2,048 tokens of samples of 20–200 tokens (each row's
  tail is one more document, as the packer pads it).

Per backend and batch: the median time of a forward and backward (triton's do_bench, the
same inputs each call) and the causal TFLOP/s of that (forward 2 matmuls, backward 5, half the
query-key pairs), the GPU time of its kernels alone (torch.profiler; a wall time well above it
means the host's work, not the kernels, sets the pace when nothing else is queued), the time
to build the backend's document description (`PackedDocs`, once per micro-batch in the trainer),
the first call's time (compiles, graph builds) and then the first call on `--fresh` new batches
of the same kind (what a run with changing batches pays: flex's block masks are data, cuDNN's
graphs are cached per bucket), and the largest relative error of the output and the three
gradients against `sdpa_docs` (exact; one SDPA call per document).
`flex+...` rows are flex_attention called with those kernel options; `cudnn-exact` is cudnn
without its padding of documents and lengths (what the buckets cost once their graphs exist).
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.models.layers.attention import PackedDocs, packed_attention  # noqa: E402
from tandem.models.layers.cudnn_attention import require_cudnn_frontend  # noqa: E402

HEAD_DIM = 128
# flex's own kernel options against its defaults (block sizes must divide the mask's 128): Hopper's
# tensor-memory loads, and larger backward and forward tiles
_BWD128 = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64}
FLEX_OPTIONS = {
    "flex+tma": {"USE_TMA": True},
    "flex+bwd128": {**_BWD128, "bwd_num_warps": 8, "bwd_num_stages": 3},
    "flex+fwd128": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "flex+tma+bwd128": {"USE_TMA": True, **_BWD128, "bwd_num_warps": 8, "bwd_num_stages": 3},
}
BACKENDS = ("flex", "varlen", "cudnn", "cudnn-exact", "flash", "sdpa_docs", "sdpa", *FLEX_OPTIONS)
BATCHES = {"mfu": (4, 4096, 256, 2304), "rl": (4, 2048, 20, 200)}  # rows, width, shortest, longest


def document_lengths(batch: str, seed: int) -> list[list[int]]:
    """Per row, document lengths drawn uniformly from the batch's range; a row's last document
    is cut to fill the row exactly (at the `rl` batch: the packer's padding)."""
    rows, width, shortest, longest = BATCHES[batch]
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(rows):
        row, left = [], width
        while left:
            n = min(left, int(torch.randint(shortest, longest + 1, (1,), generator=generator)))
            row.append(n)
            left -= n
        lengths.append(row)
    return lengths


def positions_of(lengths: list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)


def attend_with(backend: str):  # noqa: ANN201 (a packed_attention-like callable)
    """packed_attention, or flex_attention with a FLEX_OPTIONS entry's kernel options."""
    options = FLEX_OPTIONS.get(backend)
    if options is None:
        return packed_attention
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)

    def attend(q, k, v, packed, scale):  # noqa: ANN001, ANN202
        args = (t.transpose(1, 2) for t in (q, k, v))
        kwargs = {"block_mask": packed.block_mask, "scale": scale, "enable_gqa": True}
        return flex(*args, **kwargs, kernel_options=options).transpose(1, 2)

    return attend


def inputs(shape: tuple[int, int], heads: int, kv_heads: int, device: torch.device) -> list[torch.Tensor]:
    """q, k, v (leaves that take gradients) and an output gradient, fresh random values."""
    q = torch.randn(*shape, heads, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(*shape, kv_heads, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    return [q, k, v, torch.randn_like(q)]


def forward_backward(attend, q, k, v, grad, packed) -> list[torch.Tensor]:  # noqa: ANN001
    q.grad = k.grad = v.grad = None
    out = attend(q, k, v, packed, HEAD_DIM**-0.5)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def packed_docs(positions: torch.Tensor, backend: str) -> PackedDocs:
    """The documents as `backend` takes them. `cudnn-exact` is cudnn without its buckets (the
    documents and the longest length as they are, one cuDNN graph per batch): the price of the
    padding and rounding in the steady state."""
    if backend == "cudnn-exact":
        require_cudnn_frontend()
        return dataclasses.replace(PackedDocs.from_positions(positions, "varlen"), backend="cudnn")
    return PackedDocs.from_positions(positions, "flex" if backend in FLEX_OPTIONS else backend)


def first_call_ms(attend, backend: str, positions, tensors) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    start = time.perf_counter()
    forward_backward(attend, *tensors, packed_docs(positions, backend))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def kernels_ms(run, repeats: int = 10) -> float:  # noqa: ANN001
    """GPU time per call of what `run` launches: its kernels and copies, summed."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()) / repeats / 1e3


def measure(backend: str, batch: str, heads: int, kv_heads: int, fresh: int, seed: int) -> dict:
    import triton.testing

    device = torch.device("cuda")
    attend = attend_with(backend)
    lengths = document_lengths(batch, seed)
    positions = positions_of(lengths, device)
    tensors = inputs(positions.shape, heads, kv_heads, device)
    first_ms = first_call_ms(attend, backend, positions, tensors)
    fresh_ms = [
        first_call_ms(attend, backend, positions_of(document_lengths(batch, seed + 1 + i), device), tensors)
        for i in range(fresh)
    ]
    packed = packed_docs(positions, backend)
    got = forward_backward(attend, *tensors, packed)
    want = forward_backward(packed_attention, *tensors, PackedDocs.from_positions(positions, "sdpa_docs"))
    error = max(
        float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want, strict=True)
    )
    ms = triton.testing.do_bench(
        lambda: forward_backward(attend, *tensors, packed), warmup=100, rep=500, return_mode="median"
    )
    gpu_ms = kernels_ms(lambda: forward_backward(attend, *tensors, packed))
    setup_ms = triton.testing.do_bench(
        lambda: packed_docs(positions, backend), warmup=20, rep=200, return_mode="median"
    )
    pairs = sum(n * (n + 1) / 2 for row in lengths for n in row)
    flops = 7 * 2 * heads * HEAD_DIM * pairs  # 7 matmuls (fwd 2, bwd 5) of 2·d FLOPs per pair and head
    return {
        "backend": backend,
        "batch": batch,
        "heads": f"{heads}:{kv_heads}",
        "documents": sum(len(row) for row in lengths),
        "ms": ms,
        "kernels_ms": gpu_ms,
        "tflops": flops / ms / 1e9,
        "setup_ms": setup_ms,
        "first_ms": first_ms,
        "fresh_ms": fresh_ms,
        "rel_error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--batches", default=",".join(BATCHES))
    parser.add_argument("--heads", default="16:8", help="query:KV heads of 128")
    parser.add_argument("--fresh", type=int, default=3, help="first calls on that many new batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "attention_backends.jsonl"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the backends compared here are CUDA kernels)")
    heads, kv_heads = (int(n) for n in args.heads.split(":"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"{'backend':16} {'batch':5} {'docs':>5} {'fwd+bwd ms':>10} {'kernels ms':>10} {'TFLOP/s':>8} {'setup ms':>9} "
        f"{'first ms':>9} {'fresh first ms':>20} {'rel err':>8}"
    )
    for batch in args.batches.split(","):
        for backend in args.backends.split(","):
            try:
                row = measure(backend, batch, heads, kv_heads, args.fresh, args.seed)
            except Exception as e:  # a backend, option or package this machine lacks
                row = {"backend": backend, "batch": batch, "error": f"{type(e).__name__}: {e}"[:300]}
                print(f"{backend:16} {batch:5} failed: {row['error']}", flush=True)
            else:
                fresh = " ".join(f"{t:.0f}" for t in row["fresh_ms"])
                print(
                    f"{backend:16} {batch:5} {row['documents']:5} {row['ms']:10.3f} {row['kernels_ms']:10.3f} {row['tflops']:8.0f} "
                    f"{row['setup_ms']:9.2f} {row['first_ms']:9.0f} {fresh:>20} {row['rel_error']:8.1e}",
                    flush=True,
                )
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
