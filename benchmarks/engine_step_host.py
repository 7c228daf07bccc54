"""Host time of one engine step, measured on CPU with a model whose compute is negligible.

On a GPU the model's work runs asynchronously; what the host spends per step (scheduling,
building inputs, launching, appending tokens, stop checks, collecting updates) decides whether
the GPU waits. Here the model is one layer of width 32 over a 512-token vocabulary, so a step's
CPU time is mostly that host work. "bookkeeping" is a step's CPU time less the time inside the
model's forward and logits and the sampler (on a GPU: one graph replay and one or two kernel
launches), i.e. the Python around them that a GPU step must hide. Each variant runs in a fresh process (`--src` picks the source tree, so two commits can be
compared in one run); variants alternate over `--repeats` rounds and the table shows the best run of each (on a shared machine the least disturbed one).

    uv run python benchmarks/engine_step_host.py
    uv run python benchmarks/engine_step_host.py --src /tmp/base/src --src src   # before / after
    uv run python benchmarks/engine_step_host.py --prefix-caching both           # cache off / on
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, sys, time
import torch
from tandem.inference.config import InferenceConfig
from tandem.inference.engine import core as core_module
from tandem.inference.engine.api import SamplingParams
from tandem.inference.engine.core import EngineCore

spent = {"model": 0.0, "sampler": 0.0}
cache = {"seconds": 0.0}  # inside the prefix cache's register and match (part of bookkeeping)

def timed(fn, key):
    def wrapper(*a, **k):
        start = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += time.thread_time() - start
    return wrapper

args = json.loads(sys.argv[1])
torch.set_num_threads(1)
B, P, O = args["batch"], args["prompt_len"], args["output_len"]
engine = {"max_num_seqs": B, "max_model_len": P + O + 64, "kv_cache_memory_gb": 0.2,
          "prefix_caching": args["prefix_caching"]}
core = EngineCore(InferenceConfig.model_validate(
    {"model": {"name": args["model"], "dtype": "float32"}, "engine": engine}))
core.model.forward = timed(core.model.forward, "model")
core.model.logits = timed(core.model.logits, "model")
core_module.launch_sample = timed(core_module.launch_sample, "sampler")


def timed_cache(fn):
    def wrapper(*a, **k):
        start = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            cache["seconds"] += time.thread_time() - start
    return wrapper


core.blocks.register = timed_cache(core.blocks.register)
core.blocks.match_prefix = timed_cache(core.blocks.match_prefix)
params = SamplingParams(temperature=args["temperature"], max_tokens=O, ignore_eos=True)
gen = torch.Generator().manual_seed(0)

def run(tag):
    prompts = torch.randint(3, 500, (B, P), generator=gen).tolist()  # new prompts: no prefix shared
    for i, ids in enumerate(prompts):
        core.add_request(f"{tag}{i}", ids, params, 1)
    cpu, wall, host = [], [], []
    cache["seconds"], steps = 0.0, core.num_steps
    while core.has_work():
        decoding = not core.scheduler.waiting and all(s.num_uncached <= 1 for s in core.scheduler.running)
        c0, w0, m0 = time.thread_time(), time.perf_counter(), sum(spent.values())
        core.step()
        if decoding and len(core.scheduler.running) == B:  # full-batch decode steps only
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
            host.append(cpu[-1] - (sum(spent.values()) - m0))
    cache_per_step.append(cache["seconds"] / max(core.num_steps - steps, 1))
    return cpu, wall, host


cache_per_step = []

run("warm")
before = dict(core.timings)
cpu, wall, host = run("timed")
steps = len(cpu)
print(json.dumps({
    "cpu_us": 1e6 * sorted(cpu)[steps // 2], "wall_us": 1e6 * sorted(wall)[steps // 2], "steps": steps,
    "host_us": 1e6 * sorted(host)[steps // 2],
    "prefix_cache_us": 1e6 * cache_per_step[-1],
    "phases_us": {k: 1e6 * (v - before[k]) / max(core.num_steps, 1) for k, v in core.timings.items()},
}))
"""


def build_model(path: Path) -> Path:
    from tandem.models.tiny import build_tiny_model

    if not (path / "config.json").exists():
        build_tiny_model(
            out=path, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
            intermediate_size=64, vocab_size=512,
        )  # fmt: skip
    return path


def measure(src: Path, settings: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(settings)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the worker for {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", type=Path, action="append", help="source tree(s) to measure (default: src)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-step-host")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    model = build_model(args.work_dir / "model")
    srcs = args.src or [Path(__file__).resolve().parent.parent / "src"]
    caching = {"on": [True], "off": [False], "both": [False, True]}[args.prefix_caching]
    variants = [(src, cache) for src in srcs for cache in caching]
    runs: dict[tuple[Path, bool], list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for src, cache in variants:
            settings = {
                "model": str(model), "batch": args.batch, "prompt_len": args.prompt_len,
                "output_len": args.output_len, "temperature": args.temperature, "prefix_caching": cache,
            }  # fmt: skip
            runs[(src, cache)].append(measure(src, settings))
    print(
        f"\nengine step on CPU, negligible model: batch {args.batch}, {args.prompt_len} prompt + "
        f"{args.output_len} output tokens, temperature {args.temperature}; best of {args.repeats} runs (each its median step)"
    )
    print(
        f"| {'source':<36} | prefix cache | bookkeeping µs/step | of it in the cache | CPU µs/step "
        "| wall µs/step | runs (bookkeeping µs) |"
    )
    print(
        f"|{'-' * 38}|--------------|---------------------|--------------------|-------------|--------------|---|"
    )
    rows = []
    for (src, cache), results in runs.items():
        host = min(r["host_us"] for r in results)
        cpu = min(r["cpu_us"] for r in results)
        wall = min(r["wall_us"] for r in results)
        spread = " / ".join(f"{r['host_us']:.0f}" for r in results)
        cached = "on" if cache else "off"
        in_cache = min(r.get("prefix_cache_us", float("nan")) for r in results)
        print(
            f"| {str(src):<36} | {cached:<12} | {host:19.0f} | {in_cache:18.1f} | {cpu:11.0f} | {wall:12.0f} | {spread} |"
        )
        rows.append(
            {
                "src": str(src),
                "prefix_caching": cache,
                "host_us": host,
                "prefix_cache_us": in_cache,
                "cpu_us": cpu,
                "wall_us": wall,
                "runs": results,
            }
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
