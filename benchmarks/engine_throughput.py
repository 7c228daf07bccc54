"""Engine-level generation throughput: the native engine vs transformers `generate`, same run.

N requests of P random prompt tokens each generate O tokens (sampling at temperature 1, EOS
ignored). The engine gets all requests at once and runs to completion; transformers generates
the same batch in one `generate` call. Output tokens per second are compared. Every timed run
sends prompts no earlier run sent, so the prefix cache finds nothing to reuse (it is measured
on and off, back to back). The graph-replay bound: every decode graph replay is timed with CUDA
events; the bound is the output tokens over the replays' GPU time, and the engine's share of it
is (replay time) / (wall time). On CUDA the core (on its own thread and on another) and the
AsyncEngine also run with the `engine.prompt_attention` values other than the default (flash):
"auto prompts" and "varlen prompts" rows.

    uv run python benchmarks/engine_throughput.py                       # CPU, tiny model
    uv run python benchmarks/engine_throughput.py --shape host --num-requests 256 --prompt-len 8 \\
        --output-len 128 --skip-hf                                    # CPU: host work only
    python benchmarks/engine_throughput.py --shape qwen3-0.6b --num-requests 256 \\
        --prompt-len 128 --output-len 256 --out results.json            # CUDA, bf16

`--check` first verifies on the device: the decode kernel against the gather path, greedy
decoding of a float32 tiny model against transformers token for token, and the engine's
logprobs on the benchmark model against a transformers forward pass.
"""

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoModelForCausalLM

from tandem.inference.cli import freeze_heap
from tandem.inference.config import EngineConfig, InferenceConfig
from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.engine import AsyncEngine
from tandem.inference.engine.model_runner import PROMPT_KERNELS
from tandem.models.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from bench_models import SHAPES, build_random  # noqa: E402
from engine_step_host import build_model as build_host_model  # noqa: E402
from gpu_timeline import busy_by_window, gpu_idle, trace_of  # noqa: E402

DEFAULT_PROMPT_ATTENTION = EngineConfig().prompt_attention


def build_model(shape: str, out: Path, device: torch.device) -> Path:
    """`host`: engine_step_host.py's model of negligible compute, so that on CPU the run measures
    the engine's host work (the core's bookkeeping, AsyncEngine's hand-off to asyncio)."""
    if shape == "host":
        return build_host_model(out)
    return build_tiny_model(out=out) if shape == "tiny" else build_random(shape, out, device)


def engine_config(path: Path, dtype: str, args: argparse.Namespace, **engine: object) -> InferenceConfig:
    engine = {
        "max_num_seqs": max(args.num_requests, 1),
        "max_model_len": args.prompt_len + args.output_len + 64,
        "kv_cache_memory_gb": args.kv_cache_gb,
        "cuda_graphs": not args.no_cuda_graphs,
        "triton_kernels": not args.no_triton_kernels,
        **engine,
    }
    return InferenceConfig.model_validate({"model": {"name": str(path), "dtype": dtype}, "engine": engine})


def random_prompts(count: int, length: int, vocab: int, seed: int, mixed: bool = False) -> list[list[int]]:
    """`count` prompts of random ids, each `length` tokens long; with `mixed`, lengths drawn
    uniformly from length/2 to 3·length/2 (the same mean, as RL prompts vary)."""
    gen = torch.Generator().manual_seed(seed)
    if not mixed:
        return torch.randint(3, vocab, (count, length), generator=gen).tolist()
    ids = torch.randint(3, vocab, (count, length + length // 2), generator=gen).tolist()
    lengths = torch.randint(max(1, length // 2), length + length // 2 + 1, (count,), generator=gen).tolist()
    return [row[:n] for row, n in zip(ids, lengths, strict=True)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def measured(core: EngineCore) -> Iterator[dict]:
    """Time the block's run of `core` into the dict it yields, which the block gives
    "output_tokens": seconds, tok/s, engine steps, the core's host seconds by phase and, with
    CUDA graphs, their replays' GPU time and the share of the run it fills."""
    result: dict = {}
    sync(core.device)
    if core.runner.use_graphs:
        core.runner.replay_events = []
    steps, timings = core.num_steps, dict(core.timings)
    start = time.perf_counter()
    yield result
    sync(core.device)
    seconds = time.perf_counter() - start
    tokens = result["output_tokens"]
    result.update(seconds=seconds, tok_per_s=tokens / seconds, steps=core.num_steps - steps)
    result["host_seconds_by_phase"] = {k: v - timings[k] for k, v in core.timings.items()}
    events, core.runner.replay_events = core.runner.replay_events, None
    if events:
        replay = sum(a.elapsed_time(b) for a, b in events) / 1e3
        result.update(
            graph_replays=len(events),
            graph_replay_seconds=replay,
            graph_replay_ms_per_step=1e3 * replay / len(events),
            graph_replay_bound_tok_per_s=tokens / replay,
            share_of_graph_replay_bound=replay / seconds,
        )


def run_core(core: EngineCore, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """All requests at once, stepped to the end; with CUDA graphs, their replays' GPU time."""
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    with measured(core) as result:
        for i, ids in enumerate(prompts):
            core.add_request(f"{tag}-{i}", ids, params, 1)
        tokens, times, launches = 0, [], []
        while core.has_work():
            t, launched = time.perf_counter(), core.timings["model"]
            for _, updates in core.step():
                tokens += sum(len(u.token_ids) for u in updates)
            times.append(time.perf_counter() - t)
            launches.append(core.timings["model"] - launched)
        result["output_tokens"] = tokens
    result["step_ms"] = step_spread(times)
    # without a profiler: a step's host time launching the model against its wall time (which
    # also waits for the step before's tokens): launch ≈ wall means the host is what limits it
    result["first_steps_wall_launch_ms"] = [
        (round(1e3 * w, 2), round(1e3 * h, 2)) for w, h in zip(times[:8], launches[:8], strict=True)
    ]
    return result


def step_spread(times: list[float]) -> dict:
    """Which steps took the time: the first 8 (prefill) together, the median, the slowest, the last."""
    ms = sorted(1e3 * t for t in times)
    return {
        "first 8 steps": 1e3 * sum(times[:8]),
        "median step": ms[len(ms) // 2],
        "slowest step": ms[-1],
        "last step": 1e3 * times[-1],
    }


T = TypeVar("T")


def in_thread(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on a second thread while this one waits in join(): stepping the core from a
    thread other than the one that built it, as AsyncEngine does, and nothing else."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join()
    return result[0]


def one_torch_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """fn with torch's intra-op parallelism at one thread while it runs (on CPU a second thread's
    OpenMP team competes with the first's: the core stepped by another thread runs at 2/3 speed
    with two intra-op threads on two cores, at full speed with one)."""

    def run(*args: object) -> T:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(threads)

    return run


def run_async(engine: AsyncEngine, prompts: list[list[int]], output_len: int, stream: bool = True) -> dict:
    """One asyncio consumer per request; `stream=False` delivers each request once, at its end.
    Besides what `measured` reports (more steps than the core's for the same batch means the
    requests reached the engine thread over several steps), where the time went: wall time
    inside `core.step()` (called by the engine thread), the rest (the engine thread's loop, its
    waits for the GIL, the hand-off) and garbage collection in any thread."""
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    core = engine.core

    async def one(i: int, ids: list[int]) -> int:
        updates = engine.generate(f"a{i}", ids, params, stream=stream)
        return sum([len(u.token_ids) async for u in updates])

    async def main() -> int:
        return sum(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))

    gc_seconds, gc_started = [0.0], [0.0]
    plain_step = core.step

    times: list[float] = []

    def timed_step() -> list:
        t = time.perf_counter()
        out = plain_step()
        times.append(time.perf_counter() - t)
        return out

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_started[0]

    with measured(core) as result:
        core.step = timed_step  # the engine thread is idle now; it looks the method up every step
        gc.callbacks.append(on_gc)
        try:
            result["output_tokens"] = asyncio.run(main())
        finally:
            gc.callbacks.remove(on_gc)
            del core.step
    count = result["steps"]
    result["ms_per_step"] = {
        "all": 1e3 * result["seconds"] / count,
        "inside core.step": 1e3 * sum(times) / count,
        "outside core.step": 1e3 * (result["seconds"] - sum(times)) / count,
        "garbage collection": 1e3 * gc_seconds[0] / count,
    }
    result["step_ms"] = step_spread(times)
    return result


def run_hf(path: Path, prompts: list[list[int]], output_len: int, device: torch.device, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        sync(device)
    seconds = time.perf_counter() - start
    del model
    return seconds, (out.shape[1] - ids.shape[1]) * out.shape[0]


def sweep_kernel(batch: int, context: int) -> list[dict]:
    """Time the decode kernel's launch parameters on the 0.6B shape (decode_attention.py); install the fastest."""
    from decode_attention import candidates, show, time_configs

    from tandem.inference.engine import triton_decode

    rows = time_configs(candidates(), batch, context)
    show(rows, f"decode kernel, batch {batch}, context {context}", 6)
    triton_decode.CONFIG = {k: v for k, v in rows[0].items() if k not in ("us", "TB/s")}
    return rows


def timeline(core: EngineCore, prompts: list[list[int]], output_len: int) -> str:
    """One whole timed run (prefill to the last token) under torch.profiler: where the GPU sat
    idle and what the host was doing then. The profiler's own host cost (~µs per operator) is
    in it: read the gaps' places more than their sum."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = run_core(core, prompts, output_len, "timeline")
    trace = trace_of(prof)
    return (
        f"whole run under torch.profiler: {result['tok_per_s']:,.0f} tok/s, {result['steps']} steps\n"
        f"{busy_by_window(trace)}\n{gpu_idle(trace, top=15)}"
    )


def profile_decode(core: EngineCore, prompts: list[list[int]], steps: int = 30) -> str:
    """cProfile of decode steps at full batch (CPU-side cost of a step)."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(temperature=1.0, max_tokens=steps + 40, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"prof-{i}", ids, params, 1)
    while any(s.num_uncached > 1 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for _ in range(5):
        core.step()
    profiler = cProfile.Profile()
    sync(core.device)
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        core.step()
    profiler.disable()
    sync(core.device)
    per_step = (time.perf_counter() - start) / steps * 1e3
    device = decode_device_time(core, steps) if core.device.type == "cuda" else ""
    while core.has_work():
        core.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return f"decode step (profiled): {per_step:.2f} ms\n" + text.getvalue() + device


def decode_device_time(core: EngineCore, steps: int, rows: int = 15) -> str:
    """torch.profiler over `steps` more full-batch decode steps: the device's busy time per step
    against the wall time (is the GPU the bound, or does it wait for the host?), and the kernels."""
    from torch.profiler import ProfilerActivity, profile

    sync(core.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync(core.device)
        wall = (time.perf_counter() - start) / steps * 1e3
    table = prof.key_averages()
    busy = sum(e.self_device_time_total for e in table) / steps / 1e3
    kernels = table.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)
    return f"\ndecode steps under torch.profiler: {wall:.2f} ms wall, {busy:.2f} ms device time per step\n{kernels}"


def profile_prefill(core: EngineCore, prompts: list[list[int]]) -> str:
    """torch.profiler over the steps that still prefill (all requests added at once, as in a
    timed run): each step's wall time, then the ops by host time and by device time. The
    prefill steps are where a run on another thread loses most against the core's own."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"prefill-{i}", ids, params, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if core.device.type == "cuda" else [])
    steps = []  # (ms, sequences waiting before the step, running before it)
    with profile(activities=activities) as prof:
        while any(s.num_uncached > 1 for s in core.scheduler.running) or core.scheduler.waiting:
            waiting, running = len(core.scheduler.waiting), len(core.scheduler.running)
            start = time.perf_counter()
            core.step()
            sync(core.device)
            steps.append((1e3 * (time.perf_counter() - start), waiting, running))
    while core.has_work():
        core.step()
    table = prof.key_averages()
    shown = ", ".join(f"{ms:.1f} (waiting {w}, running {r})" for ms, w, r in steps)
    by_host = table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50)
    by_device = table.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=50)
    return f"prefill steps (ms, each synced): {shown}\n{by_host}\n{by_device}"


def check_device(args: argparse.Namespace, device: torch.device, work: Path, bench_model: Path) -> dict:
    """Correctness on the benchmark device; returns the measurements (and asserts exact greedy match)."""
    from tandem.inference.engine.attention import decode_attention

    results: dict = {}
    # 1. decode kernel vs gather path, bf16, ragged contexts
    if device.type == "cuda":
        from tandem.inference.engine import attention
        from tandem.inference.engine.triton_decode import paged_decode_attention

        gen = torch.Generator(device=device).manual_seed(0)
        kc = torch.randn(300, 16, 8, 128, device=device, dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(300, 16, 8, 128, device=device, dtype=torch.bfloat16, generator=gen)
        q = torch.randn(64, 16, 128, device=device, dtype=torch.bfloat16, generator=gen)
        lens = torch.randint(1, 16 * 16, (64,), device=device, generator=gen)
        tables = torch.randint(1, 300, (64, 16), device=device, generator=gen)
        kernel = attention.paged_decode_attention
        attention.paged_decode_attention = None
        reference = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, 128**-0.5)
        attention.paged_decode_attention = kernel
        out = paged_decode_attention(q, kc, vc, tables, lens, 128**-0.5).float()
        results["decode_kernel_max_abs_err_bf16"] = (out - reference).abs().max().item()
        assert results["decode_kernel_max_abs_err_bf16"] < 3e-2, results
    # 2. greedy, float32 tiny model, engine (graphs + kernel) vs transformers
    tiny = build_model("tiny", work / "tiny", device)
    core = EngineCore(engine_config(tiny, "float32", args, max_num_seqs=16, kv_cache_memory_gb=1.0))
    prompts = random_prompts(6, 1, core.vocab_size, seed=100)
    prompts = [p * k for p, k in zip(prompts, (3, 17, 33, 5, 40, 9), strict=True)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"g{i}", ids, greedy, 2)
    got: dict[str, list[int]] = {}
    while core.has_work():
        for rid, updates in core.step():
            for u in updates:
                got.setdefault(f"{rid}/{u.index}", []).extend(u.token_ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).to(device)
    matches = 0
    for i, ids in enumerate(prompts):
        ref = hf.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
            eos_token_id=None,
        )[0, len(ids) :].tolist()
        matches += (got[f"g{i}/0"] == ref) + (got[f"g{i}/1"] == ref)
    results["greedy_fp32_exact_matches"] = f"{matches}/{2 * len(prompts)}"
    del core, hf
    # 3. logprobs of the benchmark model (bf16) vs a transformers forward pass in float32
    core = EngineCore(engine_config(bench_model, "bfloat16", args, max_num_seqs=8, kv_cache_memory_gb=2.0))
    ids = random_prompts(1, 64, core.vocab_size, seed=101)[0]
    core.add_request("lp", ids, SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=1), 1)
    tokens = SampleUpdate(0)
    while core.has_work():
        for _, updates in core.step():
            for u in updates:
                tokens.extend(u)
    del core
    hf = AutoModelForCausalLM.from_pretrained(bench_model, dtype=torch.float32).to(device)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + tokens.token_ids], device=device)).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits.double(), -1).gather(
        1, torch.tensor(tokens.token_ids, device=device)[:, None]
    )
    diff = (torch.tensor(tokens.logprobs, device=device, dtype=torch.float64) - ref[:, 0]).abs()
    results["bf16_logprob_vs_fp32_mean_abs_diff"] = diff.mean().item()
    results["bf16_logprob_vs_fp32_max_abs_diff"] = diff.max().item()
    del hf
    assert matches == 2 * len(prompts), results
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=["tiny", "host", *SHAPES], default=None, help="default: tiny on CPU, 0.6B on CUDA"
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--mixed-lengths", action="store_true", help="prompt lengths from prompt-len/2 to 3·prompt-len/2"
    )
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-gb", type=float, default=None)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-triton-kernels", action="store_true", help="torch ops instead of fused kernels")
    parser.add_argument(
        "--compare-unfused", action="store_true", help="also time the engine without fused kernels"
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--check", action="store_true", help="run the device correctness checks first")
    parser.add_argument("--sweep-kernel", action="store_true", help="tune the CUDA decode kernel first")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of full-batch decode steps")
    parser.add_argument(
        "--timeline", action="store_true", help="print where the GPU sits idle in one whole run (CUDA)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tandem-engine-bench"))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.mixed_lengths and not args.skip_hf:
        parser.error("--mixed-lengths needs --skip-hf (transformers' baseline takes prompts of one length)")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("qwen3-0.6b" if device.type == "cuda" else "tiny")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.kv_cache_gb is None and device.type == "cuda":
        args.kv_cache_gb = 20.0
    path = build_model(shape, args.work_dir / shape, device)
    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": shape,
    }
    results["config"] = {k: str(v) for k, v in vars(args).items()}
    if args.check:
        try:
            results["check"] = check_device(args, device, args.work_dir, path)
        except Exception as e:  # keep going without the fused kernels, and say so
            results["check_failed"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"CHECK FAILED with fused kernels: {e}; retrying without them", flush=True)
            args.no_triton_kernels = True
            results["check"] = check_device(args, device, args.work_dir, path)
        print(json.dumps(results["check"], indent=2), flush=True)

    if args.sweep_kernel and device.type == "cuda":
        results["kernel_sweep"] = sweep_kernel(args.num_requests, args.prompt_len + args.output_len)
    vocab = None
    fresh = iter(range(1, 1000))  # a new prompt seed for every timed run: no prefix is shared

    def prompts() -> list[list[int]]:
        return random_prompts(args.num_requests, args.prompt_len, vocab, next(fresh), args.mixed_lengths)

    runs: dict[str, dict] = {}
    for cached in (True, False):
        core = EngineCore(engine_config(path, dtype, args, prefix_caching=cached))
        freeze_heap()  # as the server does after start-up
        vocab = min(core.vocab_size, len(core.tokenizer))
        name = "tandem EngineCore" + ("" if cached else ", prefix cache off")
        if cached:
            runs["tandem EngineCore (first run: graph capture)"] = run_core(
                core, prompts(), args.output_len, "c"
            )
        else:
            run_core(core, prompts(), args.output_len, "c")  # (its graphs)
        runs[name] = run_core(core, prompts(), args.output_len, "w")
        if cached:
            runs["tandem EngineCore, stepped by another thread"] = in_thread(
                run_core, core, prompts(), args.output_len, "t"
            )
            runs["tandem EngineCore, another thread, one torch thread"] = in_thread(
                one_torch_thread(run_core), core, prompts(), args.output_len, "u"
            )
        if cached and args.timeline and device.type == "cuda":
            results["timeline"] = timeline(core, prompts(), args.output_len)
            print(results["timeline"], flush=True)
        if cached and args.profile:
            results["profile"] = profile_decode(core, prompts())
            results["profile_in_thread"] = in_thread(profile_decode, core, prompts())
            print(results["profile"], "\non another thread:", results["profile_in_thread"], flush=True)
            results["prefill_profile"] = profile_prefill(core, prompts())
            results["prefill_profile_in_thread"] = in_thread(profile_prefill, core, prompts())
            print(results["prefill_profile"], "\non another thread:", results["prefill_profile_in_thread"])
        del core
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # the other engine.prompt_attention kernels (cuDNN's per-shape graphs under auto), on CUDA
    others = (
        tuple(a for a in PROMPT_KERNELS if a != DEFAULT_PROMPT_ATTENTION) if device.type == "cuda" else ()
    )
    for attention in others:
        core = EngineCore(engine_config(path, dtype, args, prompt_attention=attention))
        run_core(core, prompts(), args.output_len, "c")  # (its graphs)
        runs[f"tandem EngineCore, {attention} prompts"] = run_core(core, prompts(), args.output_len, "w")
        runs[f"tandem EngineCore, another thread, {attention} prompts"] = in_thread(
            run_core, core, prompts(), args.output_len, "t"
        )
        if args.profile:
            results[f"prefill_profile_{attention}_in_thread"] = profiled = in_thread(
                profile_prefill, core, prompts()
            )
            print(f"{attention} prompts, on another thread:", profiled)
        del core
        torch.cuda.empty_cache()
    if args.compare_unfused and not args.no_triton_kernels and device.type == "cuda":
        core = EngineCore(engine_config(path, dtype, args, triton_kernels=False))
        run_core(core, prompts(), args.output_len, "c")
        runs["tandem EngineCore, torch ops"] = run_core(core, prompts(), args.output_len, "w")
        del core
    for attention in (DEFAULT_PROMPT_ATTENTION, *others):
        engine = AsyncEngine(engine_config(path, dtype, args, prompt_attention=attention))
        freeze_heap()
        run_async(engine, prompts()[: min(8, args.num_requests)], 4)  # warm-up
        label = "" if attention == DEFAULT_PROMPT_ATTENTION else f", {attention} prompts"
        for name, stream in (("streams", True), ("whole", False)):
            runs[f"tandem AsyncEngine, {name}{label}"] = run_async(engine, prompts(), args.output_len, stream)
        if attention == DEFAULT_PROMPT_ATTENTION:
            switch = sys.getswitchinterval()
            sys.setswitchinterval(0.005)  # Python's default, for comparison with the engine's own
            runs["tandem AsyncEngine, whole, GIL switch 5 ms"] = run_async(
                engine, prompts(), args.output_len, False
            )
            sys.setswitchinterval(switch)
        asyncio.run(engine.shutdown())
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_hf:
        seconds, tokens = run_hf(path, prompts(), args.output_len, device, getattr(torch, dtype))
        runs["transformers generate"] = {
            "seconds": seconds,
            "output_tokens": tokens,
            "tok_per_s": tokens / seconds,
        }
    results["runs"] = runs
    on, off = runs["tandem EngineCore"], runs["tandem EngineCore, prefix cache off"]
    results["prefix_cache_cost"] = 1 - on["tok_per_s"] / off["tok_per_s"]

    print(
        f"\n{shape} on {results['device']}, {dtype}: {args.num_requests} requests × "
        f"{'~' if args.mixed_lengths else ''}{args.prompt_len} prompt + {args.output_len} output tokens"
    )
    print(
        f"| {'system':<46} | {'seconds':>8} | {'output tok/s':>12} | {'steps':>5} | graph replay ms/step | share of bound |"
    )
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 14}|{'-' * 7}|----------------------|----------------|")
    for name, r in runs.items():
        replay = f"{r['graph_replay_ms_per_step']:20.2f}" if "graph_replay_ms_per_step" in r else f"{'-':>20}"
        share = (
            f"{r['share_of_graph_replay_bound']:14.0%}"
            if "share_of_graph_replay_bound" in r
            else f"{'-':>14}"
        )
        steps = f"{r['steps']:5d}" if "steps" in r else f"{'-':>5}"
        print(
            f"| {name:<46} | {r['seconds']:8.2f} | {r['tok_per_s']:12,.0f} | {steps} | {replay} | {share} |"
        )
    print(
        f"prefix cache on vs off (no prompt shares a prefix): {results['prefix_cache_cost']:+.1%} throughput cost"
    )
    print("\nwhere a step's wall time goes (ms per engine step; core = the core's own host phases)")
    for name, r in runs.items():
        if not r.get("steps"):
            continue
        parts = r.get("ms_per_step") or {"all": 1e3 * r["seconds"] / r["steps"]}
        phases = {f"core {k}": 1e3 * v / r["steps"] for k, v in r.get("host_seconds_by_phase", {}).items()}
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in {**parts, **phases}.items()))
        if "step_ms" in r:
            print("    " + ", ".join(f"{k} {v:.1f} ms" for k, v in r["step_ms"].items()))
        if "first_steps_wall_launch_ms" in r:
            pairs = r["first_steps_wall_launch_ms"]
            print(
                "    first steps, wall / model launch ms: "
                + ", ".join(f"{w:.1f} / {h:.1f}" for w, h in pairs)
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
