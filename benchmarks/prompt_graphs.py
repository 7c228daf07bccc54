"""Steps with prompts as graphed pieces (`engine.prompt_graphs`, piecewise.py) against the plain
eager forward, in one call: the engine core at a Qwen3-0.6B shape (random weights), each variant
in its own core, in the order plain, pieces, pieces, plain (each core warmed first by one untimed
run, which also captures its graphs).

Workloads (all requests of a run sent at once unless said otherwise; prompts never repeat, so the
prefix cache finds nothing):
- burst: N prompts of P tokens, O new tokens each (inference_throughput.py's shape; its prefill
  steps are the ones that were host-bound);
- mixed: the same with prompt lengths from P/2 to 3P/2 (other buckets, padded batches);
- trickle: the requests arrive a few per step while the others decode, so most steps mix decodes
  with prompts (a server under RL load).

Per variant: output tok/s, the first 8 steps' wall time (the prefill phase of a burst), the median
step, each of the first steps' wall against its host time launching the model (launch ≈ wall: the
host limits the step), the warm-up run's time (graph captures included) and the device memory
the core reserves after it.

    python benchmarks/prompt_graphs.py --out results.json                 # CUDA
    uv run python benchmarks/prompt_graphs.py --shape tiny --num-requests 16 --prompt-len 32 \\
        --output-len 16                                                  # CPU: a check that it runs
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tandem.inference.engine.api import SamplingParams
from tandem.inference.engine.core import EngineCore

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import build_model, engine_config, random_prompts, run_core  # noqa: E402

VARIANTS = {"plain": False, "pieces": True}


def run_trickle(core: EngineCore, prompts: list[list[int]], output_len: int, per_step: int, tag: str) -> dict:
    """`per_step` new requests before each step until all are in, then steps to the end."""
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    pending = list(enumerate(prompts))
    tokens, times, mixed = 0, [], 0
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    while pending or core.has_work():
        for i, ids in pending[:per_step]:
            core.add_request(f"{tag}-{i}", ids, params, 1)
        pending = pending[per_step:]
        running = len(core.scheduler.running)
        t = time.perf_counter()
        for _, updates in core.step():
            tokens += sum(len(u.token_ids) for u in updates)
        times.append(time.perf_counter() - t)
        mixed += bool(running and core.scheduler.running and pending)
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "output_tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "steps": len(times),
        "steps_with_arrivals_beside_decodes": mixed,
        "median_step_ms": 1e3 * statistics.median(times),
    }


def measure(path: Path, args: argparse.Namespace, dtype: str, pieces: bool, seeds: Iterator[int]) -> dict:
    core = EngineCore(engine_config(path, dtype, args, prompt_graphs=pieces))
    vocab = min(core.vocab_size, len(core.tokenizer))

    def prompts(mixed: bool = False) -> list[list[int]]:
        return random_prompts(args.num_requests, args.prompt_len, vocab, next(seeds), mixed)

    start = time.perf_counter()
    run_core(core, prompts(), args.output_len, "warm")  # graphs for the burst's buckets
    run_core(core, prompts(True), args.output_len, "warm-mixed")
    run_trickle(core, prompts(True), args.output_len, args.per_step, "warm-trickle")
    result: dict = {"warm_up_seconds": time.perf_counter() - start}
    if core.device.type == "cuda":
        result["reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    if core.runner.piecewise is not None:
        result["buckets_captured"] = sorted(core.runner.piecewise.buckets)
    result["burst"] = run_core(core, prompts(), args.output_len, "burst")
    result["mixed"] = run_core(core, prompts(True), args.output_len, "mixed")
    result["trickle"] = run_trickle(core, prompts(True), args.output_len, args.per_step, "trickle")
    del core
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default=None, help="default: qwen3-0.6b on CUDA, tiny on CPU")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--per-step", type=int, default=16, help="trickle: requests arriving before each step"
    )
    parser.add_argument("--kv-cache-gb", type=float, default=None)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tandem-engine-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.no_cuda_graphs = args.no_triton_kernels = False  # (what engine_config reads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = args.shape or ("qwen3-0.6b" if cuda else "tiny")
    if args.kv_cache_gb is None and cuda:
        args.kv_cache_gb = 20.0
    dtype = "bfloat16" if cuda else "float32"
    path = build_model(shape, args.work_dir / shape, device)
    seeds = iter(range(1, 10_000))
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for name in ("plain", "pieces", "pieces", "plain"):
        runs[name].append(measure(path, args, dtype, VARIANTS[name], seeds))
        print(name, json.dumps(runs[name][-1]), flush=True)
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": shape,
               "config": {k: str(v) for k, v in vars(args).items()}, "runs": runs}  # fmt: skip
    print(
        f"\n{shape}, {args.num_requests} requests × {args.prompt_len} prompt + {args.output_len} output tokens"
    )
    print("| variant | run | burst tok/s | burst first 8 steps ms | burst median step ms | mixed tok/s "
          "| trickle tok/s | trickle median step ms | warm-up s | reserved GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, results_of in runs.items():
        for i, r in enumerate(results_of):
            burst, mixed, trickle = r["burst"], r["mixed"], r["trickle"]
            print(
                f"| {name} | {i + 1} | {burst['tok_per_s']:,.0f} | {burst['step_ms']['first 8 steps']:.1f} "
                f"| {burst['step_ms']['median step']:.2f} | {mixed['tok_per_s']:,.0f} | {trickle['tok_per_s']:,.0f} "
                f"| {trickle['median_step_ms']:.2f} | {r['warm_up_seconds']:.1f} | {r.get('reserved_gib', 0):.2f} |"
            )
    for name, results_of in runs.items():
        print(
            f"{name}: burst's first steps (wall ms, launch ms):",
            results_of[-1]["burst"]["first_steps_wall_launch_ms"],
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
