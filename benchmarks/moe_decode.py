"""Qwen3-MoE decode on one GPU: a random-init Qwen3-30B-A3B shape (128 experts, top 8) with its
layer count cut to fit, through the engine (CUDA graphs, the trainer's router and grouped-GEMM
experts) at 64 and 256 concurrent requests: output tok/s over the whole run and over its decode
steps, and the size of the weights served.

    python benchmarks/moe_decode.py --num-layers 12 --out moe.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.core import EngineCore

sys.path.insert(0, str(Path(__file__).parent))
from bench_models import SHAPES, build_random, decode_throughput  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=12, help="of the shape's 48")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-gb", type=float, default=20.0)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tandem-moe-bench"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = "qwen3-30b-a3b"
    path = build_random(
        shape, args.work_dir / f"{shape}-{args.num_layers}l", torch.device("cuda"), args.num_layers
    )
    settings = {
        "max_num_seqs": max(args.concurrency),
        "max_model_len": args.prompt_len + args.output_len + 64,
        "kv_cache_memory_gb": args.kv_cache_gb,
    }
    start = time.perf_counter()
    core = EngineCore(
        InferenceConfig.model_validate(
            {"model": {"name": str(path), "dtype": "bfloat16"}, "engine": settings}
        )
    )
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "shape": {**SHAPES[shape], "num_layers": args.num_layers},
        "engine_start_s": time.perf_counter() - start,
        "weights_gib": sum(p.numel() * p.element_size() for p in core.model.state_dict().values()) / 2**30,
        "cuda_graphs": core.runner.use_graphs,
    }
    for c in args.concurrency:
        results[f"decode_{c}"] = decode_throughput(core, c, args.prompt_len, args.output_len, seed=c)
        print(json.dumps(results[f"decode_{c}"]), flush=True)
    print(f"\n{shape} cut to {args.num_layers} of 48 layers on {results['device']} "
          f"({results['weights_gib']:.1f} GiB of bf16 weights, CUDA graphs {results['cuda_graphs']})")  # fmt: skip
    print("| concurrency | output tok/s | decode-step tok/s |")
    for c in args.concurrency:
        r = results[f"decode_{c}"]
        print(f"| {c:11d} | {r['tok_per_s']:12,.0f} | {r['decode_tok_per_s']:17,.0f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
