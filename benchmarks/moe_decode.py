"""MoE decode on one GPU: a random-init model of a real MoE shape with its layer count cut to fit,
through the engine (CUDA graphs, the trainer's router and grouped-GEMM experts) at 64 and 256
concurrent requests: output tok/s over the whole run and over its decode steps, and the size of
the weights served.

    python benchmarks/moe_decode.py --num-layers 12 --out moe.json          # Qwen3-30B-A3B
    python benchmarks/moe_decode.py --shape all --out families.json         # and GLM-4.5-Air, MiniMax-M2, GLM-5

Shapes and their default cuts (bf16 weights, written once to --work-dir, so the cut also bounds
the disk they take: ≈ 20–30 GB each, and `--delete` removes each after its run): Qwen3-30B-A3B
12 of 48 layers; GLM-4.5-Air 6 of 46 (the first dense); MiniMax-M2 3 of 62; GLM-5 2 of 78 (one
dense, one MoE: a MoE layer of GLM-5 is 9.7B parameters). GLM-5 decodes through MLA's
compressed cache and the sparse-attention indexer (with these prompt and output lengths every
key is within the indexer's 2,048).
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.core import EngineCore

sys.path.insert(0, str(Path(__file__).parent))
from bench_models import FAMILY_SHAPES, SHAPES, build_random, decode_throughput  # noqa: E402

CUTS = {"qwen3-30b-a3b": (12, None), "glm-4.5-air": (6, None), "minimax-m2": (3, None), "glm-5": (2, 1)}


def bench_shape(shape: str, num_layers: int | None, args: argparse.Namespace) -> dict:
    layers, dense = CUTS[shape]
    layers = num_layers or layers
    path = build_random(shape, args.work_dir / f"{shape}-{layers}l", torch.device("cuda"), layers, dense)
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
    total = (
        FAMILY_SHAPES[shape]["num_hidden_layers"] if shape in FAMILY_SHAPES else SHAPES[shape]["num_layers"]
    )
    results: dict = {
        "shape": shape,
        "layers": f"{layers} of {total}",
        "engine_start_s": time.perf_counter() - start,
        "weights_gib": sum(p.numel() * p.element_size() for p in core.model.state_dict().values()) / 2**30,
        "cuda_graphs": core.runner.use_graphs,
    }
    for c in args.concurrency:
        results[f"decode_{c}"] = decode_throughput(core, c, args.prompt_len, args.output_len, seed=c)
        print(json.dumps({"shape": shape, **results[f"decode_{c}"]}), flush=True)
    del core
    torch.cuda.empty_cache()
    if args.delete:
        shutil.rmtree(path)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[*CUTS, "all"])
    parser.add_argument("--num-layers", type=int, help="layers kept (default: the shape's cut above)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-gb", type=float, default=20.0)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tandem-moe-bench"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--delete", action="store_true", help="remove each built model after its run")
    args = parser.parse_args()
    shapes = list(CUTS) if args.shape == "all" else [args.shape]
    runs = []
    for shape in shapes:
        try:
            runs.append(bench_shape(shape, args.num_layers, args))
        except Exception as e:  # one shape failing (memory, a missing model type) leaves the others
            runs.append({"shape": shape, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(runs[-1]), flush=True)
    print(
        f"\nMoE decode on {torch.cuda.get_device_name()}, prompt {args.prompt_len}, output {args.output_len}"
    )
    print("| shape | layers | weights GiB | CUDA graphs | concurrency | output tok/s | decode-step tok/s |")
    for r in runs:
        if "error" in r:
            print(f"| {r['shape']} | failed: {r['error']} |")
            continue
        for c in args.concurrency:
            d = r[f"decode_{c}"]
            print(f"| {r['shape']} | {r['layers']} | {r['weights_gib']:.1f} | {r['cuda_graphs']} | {c} | "
                  f"{d['tok_per_s']:,.0f} | {d['decode_tok_per_s'] or 0:,.0f} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
