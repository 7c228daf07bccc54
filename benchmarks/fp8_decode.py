"""FP8 weights on one GPU: the FP8 matmuls side by side on a Qwen3-8B shape's layers, then
bf16 vs FP8 decode tok/s through the engine at 64 and 256 concurrent requests, and the mismatch
between the FP8 sampler and a bf16 trainer on the same tokens, all in one run.

    python benchmarks/fp8_decode.py --out fp8.json                     # CUDA (SM89+; SM90 for blockwise)

Matmuls: bf16 `F.linear` against `Fp8Weight` with each kernel ("triton", "w8a8", "blockwise",
"rowwise", fp8.py) at M = 64 and 256 rows, GPU time in a CUDA graph over weight copies larger than
L2 in all (as a decode step reads them: cold, no launch overhead); the fastest in total is the
one the FP8 engine then runs with (`--kernel` names one or more instead; for the row-wise kernel also
"rowwise@R": the unit-scaled product up to R rows instead of fp8.UNIT_SCALED_ROWS, and
"rowwise-separate": without the fused launches, a quantizer and a scaling pass around every
matmul). Engines: random-init Qwen3-8B shape
(bf16; `bench_models.py`), P prompt + O output tokens, temperature 1; the bf16 engine runs first and
again last (`--bf16-once`: first only), and each ratio is taken against the mean of its two runs
(an H200 gave one bf16 run 9 % below the next call's, 2026-12-07: a drift between engines shows
in the two runs, printed beside their mean, and in `bf16_drift_C` of --out). Mismatch: the tokens the
FP8 engine sampled (and the bf16 engine, as the baseline) are scored by transformers in bf16 —
the trainer's stand-in — and KL(sampler ‖ trainer) is estimated per token as mean(log μ − log π)
(k1) and mean((π/μ − 1) − log(π/μ)) (k3). A random-init model's next-token distribution is
close to uniform, so these KLs are far below a trained model's: compare fp8 against the bf16
baseline row, not against RL runs.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tandem.inference.config import InferenceConfig
from tandem.inference.engine import fp8 as fp8_module
from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.fp8 import FP8_KERNELS, Fp8Weight
from tandem.inference.engine.triton_fp8 import config_for

sys.path.insert(0, str(Path(__file__).parent))
from bench_models import SHAPES, build_random, decode_throughput  # noqa: E402
from engine_throughput import decode_device_time  # noqa: E402


def layer_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    q, kv = shape["num_heads"] * shape["head_dim"], shape["num_kv_heads"] * shape["head_dim"]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


L2_FLUSH_BYTES = 256 * 2**20  # more than the GPU's L2 (50 MB on H100/H200)


def time_us(calls: list, repeats: int = 20) -> float:
    """GPU µs per call, as a decode step runs it: `calls` (closures over distinct weight copies,
    more bytes in all than L2, so no call reads a weight that is still cached) captured once into
    a CUDA graph, replayed `repeats` times; launch overhead is not counted."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (and Triton's autotuning) outside the capture
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (repeats * len(calls)) * 1e3


def matmuls(shape: dict, rows: tuple[int, ...]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, (n, k) in layer_shapes(shape).items():
        copies = max(1, -(-L2_FLUSH_BYTES // (n * k * 2)))
        ws = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(copies)
        ]
        weights = {}
        for kernel in FP8_KERNELS:
            weights[kernel] = [Fp8Weight(n, k, kernel, torch.device("cuda")) for _ in ws]
            for fp8, w in zip(weights[kernel], ws, strict=True):
                fp8.load(0, w)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            bf16 = [lambda w=w: F.linear(x, w) for w in ws]  # noqa: B023
            row = {"layer": name, "N": n, "K": k, "M": m, "bf16_us": time_us(bf16)}
            for kernel, fp8s in weights.items():
                try:
                    ref = x.float() @ fp8s[0].dequantized(torch.float32).T
                    row[f"{kernel}_rel_err"] = ((fp8s[0](x).float() - ref).norm() / ref.norm()).item()
                    row[f"{kernel}_us"] = time_us([lambda f=f: f(x) for f in fp8s])  # noqa: B023
                    if kernel == "triton":  # (BLOCK_M, BLOCK_N, SPLIT_K, warps, stages) its tuning chose
                        row["triton_config"] = list(config_for(m, n, k, x.dtype, x.device))
                except Exception as e:  # a kernel this torch / device lacks: say so, keep going
                    row[f"{kernel}_error"] = f"{type(e).__name__}: {e}"[:300]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def profile_decode(core: EngineCore, concurrency: int, args: argparse.Namespace, steps: int = 20) -> str:
    """The kernels of `steps` full-batch decode steps at `concurrency` (torch.profiler): where a
    step's device time goes, per kernel."""
    vocab = min(core.vocab_size, len(core.tokenizer))
    prompts = torch.randint(
        3, vocab, (concurrency, args.prompt_len), generator=torch.Generator().manual_seed(5)
    )
    params = SamplingParams(temperature=1.0, max_tokens=steps + 20, ignore_eos=True)
    for i, ids in enumerate(prompts.tolist()):
        core.add_request(f"profile-{i}", ids, params, 1)
    while core.scheduler.waiting or any(s.num_uncached > 1 for s in core.scheduler.running):
        core.step()
    for _ in range(5):
        core.step()
    table = decode_device_time(core, steps, rows=40)
    while core.has_work():
        core.step()
    return table


def engine(path: Path, args: argparse.Namespace, **engine: object) -> EngineCore:
    settings = {
        "max_num_seqs": max(args.concurrency),
        "max_model_len": args.prompt_len + args.output_len + 64,
        "kv_cache_memory_gb": args.kv_cache_gb,
        **engine,
    }
    return EngineCore(
        InferenceConfig.model_validate(
            {"model": {"name": str(path), "dtype": "bfloat16"}, "engine": settings}
        )
    )


def sample_with_logprobs(
    core: EngineCore, count: int, args: argparse.Namespace
) -> list[tuple[list[int], SampleUpdate]]:
    vocab = min(core.vocab_size, len(core.tokenizer))
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, vocab, (count, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=11)
    for i, ids in enumerate(prompts):
        core.add_request(f"kl{i}", ids, params, 1)
    got: dict[str, SampleUpdate] = {}
    while core.has_work():
        for rid, updates in core.step():
            for u in updates:
                got.setdefault(rid, SampleUpdate(0)).extend(u)
    return [(prompts[i], got[f"kl{i}"]) for i in range(count)]


def mismatch(path: Path, samples: dict[str, list[tuple[list[int], SampleUpdate]]]) -> dict[str, dict]:
    """KL(sampler ‖ bf16 transformers) per sampler, on the tokens it drew."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    out = {}
    for name, rows in samples.items():
        diffs = []
        for prompt, tokens in rows:
            ids = torch.tensor([prompt + tokens.token_ids], device=device)
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            trainer = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None])[:, 0].double()
            sampler = torch.tensor(tokens.logprobs, device=device, dtype=torch.float64)
            diffs.append(sampler - trainer)
        d = torch.cat(diffs)
        out[name] = {
            "tokens": d.numel(),
            "kl_k1": d.mean().item(),
            "kl_k3": ((-d).exp() - 1 + d).mean().item(),
            "max_abs_logprob_diff": d.abs().max().item(),
        }
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-gb", type=float, default=30.0)
    parser.add_argument(
        "--kernel",
        nargs="+",
        help="the engines' kernels; default: the fastest in the matmul table",
    )
    parser.add_argument("--bf16-once", action="store_true", help="the bf16 engine first only, not also last")
    parser.add_argument("--kl-samples", type=int, default=32, help="0: no mismatch measurement")
    parser.add_argument(
        "--profile", action="store_true", help="print each engine's decode kernels at the first concurrency"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tandem-fp8-bench"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for k in args.kernel or []:
        if k.partition("@")[0].removesuffix("-separate") not in FP8_KERNELS:
            parser.error(f"--kernel {k}: not one of {FP8_KERNELS} (rowwise@ROWS, rowwise-separate)")
    results: dict = {"device": torch.cuda.get_device_name(), "shape": args.shape}
    results["config"] = {k: str(v) for k, v in vars(args).items()}
    table = matmuls(SHAPES[args.shape], tuple(args.concurrency))
    results["matmuls"] = table

    def usable(r: dict, k: str) -> bool:  # ran, and computed what the dequantized weight gives
        return f"{k}_us" in r and r[f"{k}_rel_err"] < 0.05

    totals = {k: sum(r[f"{k}_us"] if usable(r, k) else float("inf") for r in table) for k in FP8_KERNELS}
    results["matmul_total_us"] = {"bf16": sum(r["bf16_us"] for r in table), **totals}
    kernels = args.kernel or [min(totals, key=totals.get)]
    results["kernels"] = kernels
    path = build_random(args.shape, args.work_dir / args.shape, torch.device("cuda"))
    samples = {}
    engines = [("bf16", {})] + [(f"fp8-{k}", {"quantization": "fp8", "fp8_kernel": k}) for k in kernels]
    if not args.bf16_once:
        engines.append(("bf16-last", {}))
    unit_rows, fuse = fp8_module.UNIT_SCALED_ROWS, fp8_module.fuse_launches
    for name, settings in engines:
        start = time.perf_counter()
        if name.startswith("fp8-"):  # the variants: a setting of fp8.py for this engine's build
            settings["fp8_kernel"], _, rows = settings["fp8_kernel"].partition("@")
            fp8_module.UNIT_SCALED_ROWS = int(rows) if rows else unit_rows
            separate = settings["fp8_kernel"] == "rowwise-separate"
            settings["fp8_kernel"] = settings["fp8_kernel"].removesuffix("-separate")
            fp8_module.fuse_launches = (lambda model: None) if separate else fuse
        core = engine(path, args, **settings)
        results[f"{name}_engine_start_s"] = time.perf_counter() - start
        results[f"{name}_weights_gib"] = torch.cuda.memory_allocated() / 2**30 - args.kv_cache_gb
        for c in args.concurrency:
            results[f"{name}_decode_{c}"] = decode_throughput(
                core, c, args.prompt_len, args.output_len, seed=c
            )
            print(name, json.dumps(results[f"{name}_decode_{c}"]), flush=True)
        if args.profile and name != "bf16-last":
            print(
                f"{name} at {args.concurrency[0]} concurrent:",
                profile_decode(core, args.concurrency[0], args),
            )
        if args.kl_samples and name != "bf16-last":
            samples[name] = sample_with_logprobs(core, args.kl_samples, args)
        del core
        torch.cuda.empty_cache()
    results["mismatch"] = mismatch(path, samples) if samples else {}

    print(f"\n{args.shape} on {results['device']}: FP8 matmuls (µs; rel. error vs the dequantized weight)")
    print(f"| {'layer':<8} | {'M':>4} | {'bf16':>8} | " + " | ".join(f"{k:>18}" for k in FP8_KERNELS) + " |")
    for r in table:
        cells = [
            f"{r[f'{k}_us']:8.1f} ({r[f'{k}_rel_err']:.1e})" if f"{k}_us" in r else f"{'failed':>18}"
            for k in FP8_KERNELS
        ]
        print(f"| {r['layer']:<8} | {r['M']:4d} | {r['bf16_us']:8.1f} | " + " | ".join(cells) + " |")
    print(
        "| concurrency | kernel | bf16 decode tok/s (first, last) | fp8 tok/s (decode) | fp8 / bf16 (decode) |"
    )
    for c in args.concurrency:
        runs = [
            results[f"{n}_decode_{c}"]["decode_tok_per_s"]
            for n in ("bf16", "bf16-last")
            if f"{n}_decode_{c}" in results
        ]
        bf16 = sum(runs) / len(runs)
        results[f"bf16_decode_mean_{c}"] = bf16
        if len(runs) == 2:
            results[f"bf16_drift_{c}"] = runs[1] / runs[0]
        for kernel in kernels:
            f = results[f"fp8-{kernel}_decode_{c}"]
            ratio = f["decode_tok_per_s"] / bf16
            results[f"fp8-{kernel}_speedup_{c}"] = ratio
            print(f"| {c:11d} | {kernel} | {bf16:8,.0f} ({', '.join(f'{r:,.0f}' for r in runs)}) | "
                  f"{f['tok_per_s']:8,.0f} ({f['decode_tok_per_s']:8,.0f}) | {ratio:19.2f} |")  # fmt: skip
    for name, m in results["mismatch"].items():
        print(f"mismatch {name} sampler vs bf16 transformers: KL k1 {m['kl_k1']:.2e}, k3 {m['kl_k3']:.2e}, "
              f"max |Δ logprob| {m['max_abs_logprob_diff']:.3f} over {m['tokens']} tokens")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
