"""One table of issue 11's targets from the JSON files benchmarks/gpu_engine.sh writes.

    python benchmarks/engine_report.py OUT_DIR

A measurement whose file is missing or incomplete shows as "-" (its log in OUT_DIR says why).
"""

import json
import sys
from pathlib import Path

# the engine.prompt_attention values gpu_engine.sh compares with the default (flash)
OTHER_PROMPT_ATTENTION = ("auto", "varlen")


def load(folder: Path, name: str) -> dict:
    path = folder / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def get(data: dict, *keys: str) -> float | None:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data if isinstance(data, int | float) else None


def prompt_kernels(runs: dict, default: str, other: str | None = None) -> str | None:
    """tok/s of an engine run with engine.prompt_attention flash (the default), auto and varlen
    (engine_throughput.py)."""
    found = [get(runs, default, "tok_per_s")] + [
        get(runs, f"{other or default}, {a} prompts", "tok_per_s") for a in OTHER_PROMPT_ATTENTION
    ]
    return (
        " / ".join("-" if v is None else f"{v / 1e3:.1f}k" for v in found) if found[0] is not None else None
    )


def main() -> None:
    folder = Path(sys.argv[1])
    engine, http, fp8, moe, prefix, pieces, pieces_http = (
        load(folder, f)
        for f in (
            "engine.json",
            "http.json",
            "fp8.json",
            "moe.json",
            "prefix.json",
            "prompt_graphs.json",
            "http_pieces.json",
        )
    )
    piece_phases = pieces_http.get("phases", {})
    phases = http.get("phases", {})
    runs = engine.get("runs", {})
    moe = (moe.get("runs") or [{}])[0]  # moe_decode.py writes one entry per shape; the script runs one
    hf = get(runs, "transformers generate", "tok_per_s")
    stream = phases.get("tandem server, streaming", {})
    ttft_means = (
        f"{stream['ttft_mean_ms']:.0f} / {stream['server_ttft_mean_ms']:.0f}"
        if "ttft_mean_ms" in stream and "server_ttft_mean_ms" in stream
        else None
    )
    kernels = fp8.get("kernels") or ["?"]  # the FP8 kernels the engines ran (gpu_engine.sh: rowwise, triton)
    whole = get(phases, "tandem server, whole", "output_tokens_per_s")

    def prefill_saved(workload: str) -> float | None:  # prefill tokens computed, cache off / on
        off, on = (get(prefix, f"{workload}, cache {c}", "prefill_tokens_computed") for c in ("off", "on"))
        return off / on if off is not None and on else None

    def pieces_gain(workload: str) -> float | None:  # prompt_graphs.py: mean tok/s, pieces / plain
        runs = pieces.get("runs", {})
        means = [
            sum(r[workload]["tok_per_s"] for r in runs.get(name, [])) / len(runs[name])
            if runs.get(name)
            else None
            for name in ("pieces", "plain")
        ]
        return means[0] / means[1] if None not in means else None

    rows = [
        ("HTTP whole responses, tok/s", whole, ">=", 60_000, "{:,.0f}"),
        ("HTTP whole, prompt graphs (pieces call)", get(piece_phases, "tandem server, whole", "output_tokens_per_s"), ">=", 60_000, "{:,.0f}"),
        ("HTTP whole, plain prompt steps, tok/s", get(piece_phases, "tandem server, whole, plain prompt steps", "output_tokens_per_s"), ">=", 60_000, "{:,.0f}"),
        ("HTTP streaming, plain prompt steps, tok/s", get(piece_phases, "tandem server, streaming, plain prompt steps", "output_tokens_per_s"), ">=", 40_000, "{:,.0f}"),
        ("HTTP streaming, plain prompt steps, TTFT p50 (ms)", get(piece_phases, "tandem server, streaming, plain prompt steps", "ttft_p50_ms"), "<=", 300, "{:,.0f}"),
        *((f"EngineCore {w}: prompt graphs / plain", pieces_gain(w), "", None, "{:.3f}x") for w in ("burst", "mixed", "trickle")),
        ("HTTP streaming, tok/s", get(phases, "tandem server, streaming", "output_tokens_per_s"), ">=", 40_000, "{:,.0f}"),
        ("HTTP streaming, TTFT p50 (ms)", get(phases, "tandem server, streaming", "ttft_p50_ms"), "<=", 300, "{:,.0f}"),
        ("HTTP streaming, TTFT mean client / server ms", ttft_means, "", None, "{}"),
        *(row for a in OTHER_PROMPT_ATTENTION for row in (
            (f"HTTP whole, {a} prompts, tok/s", get(phases, f"tandem server, whole, {a} prompts", "output_tokens_per_s"), ">=", 60_000, "{:,.0f}"),
            (f"HTTP streaming, {a} prompts, tok/s", get(phases, f"tandem server, streaming, {a} prompts", "output_tokens_per_s"), ">=", 40_000, "{:,.0f}"),
            (f"HTTP streaming, {a} prompts, TTFT p50 (ms)", get(phases, f"tandem server, streaming, {a} prompts", "ttft_p50_ms"), "<=", 300, "{:,.0f}"),
        )),
        ("HTTP whole, core process, tok/s", get(phases, "tandem server, whole, core process", "output_tokens_per_s"), ">=", 60_000, "{:,.0f}"),
        ("HTTP streaming, core process, tok/s", get(phases, "tandem server, streaming, core process", "output_tokens_per_s"), ">=", 40_000, "{:,.0f}"),
        ("HTTP streaming, core process, TTFT p50 (ms)", get(phases, "tandem server, streaming, core process", "ttft_p50_ms"), "<=", 300, "{:,.0f}"),
        ("AsyncEngine whole: flash / auto / varlen", prompt_kernels(runs, "tandem AsyncEngine, whole"), "", None, "{}"),
        ("EngineCore, other thread: flash / auto / varlen", prompt_kernels(runs, "tandem EngineCore, stepped by another thread", "tandem EngineCore, another thread"), "", None, "{}"),
        ("EngineCore, share of its graph-replay bound", get(runs, "tandem EngineCore", "share_of_graph_replay_bound"), ">=", 0.70, "{:.0%}"),
        ("EngineCore, tok/s", get(runs, "tandem EngineCore", "tok_per_s"), "", None, "{:,.0f}"),
        ("EngineCore, graph-replay bound tok/s", get(runs, "tandem EngineCore", "graph_replay_bound_tok_per_s"), "", None, "{:,.0f}"),
        ("prefix cache cost, HTTP whole, nothing shared", get(phases, "prefix_cache_cost"), "<=", 0.03, "{:+.1%}"),
        ("prefix cache cost, EngineCore, nothing shared", get(engine, "prefix_cache_cost"), "<=", 0.03, "{:+.1%}"),
        ("prefix cache saves prefill: 8 same prompts", prefill_saved("8 requests of one prompt"), ">=", 2.0, "{:.2f}x"),
        ("prefix cache saves prefill: Wordle rollouts", prefill_saved("wordle rollouts"), ">=", 2.0, "{:.2f}x"),
        ("transformers generate (same run), tok/s", hf, "", None, "{:,.0f}"),
        ("HTTP whole / transformers", whole / hf if whole and hf else None, "", None, "{:.1f}x"),
        *(row for k in kernels for row in (
            (f"FP8 ({k}) / bf16 decode, 16 concurrent", get(fp8, f"fp8-{k}_speedup_16"), "", None, "{:.2f}x"),
            (f"FP8 ({k}) / bf16 decode, 64 concurrent", get(fp8, f"fp8-{k}_speedup_64"), ">=", 1.5, "{:.2f}x"),
            (f"FP8 ({k}) / bf16 decode, 256 concurrent", get(fp8, f"fp8-{k}_speedup_256"), ">=", 1.25, "{:.2f}x"),
            (f"FP8 ({k}) sampler vs bf16 trainer, KL (k3)", get(fp8, "mismatch", f"fp8-{k}", "kl_k3"), "", None, "{:.2e}"),
        )),
        ("bf16 sampler vs bf16 trainer, KL (k3)", get(fp8, "mismatch", "bf16", "kl_k3"), "", None, "{:.2e}"),
        ("Qwen3-30B-A3B shape (cut), decode tok/s, 64", get(moe, "decode_64", "decode_tok_per_s"), "", None, "{:,.0f}"),
        ("Qwen3-30B-A3B shape (cut), decode tok/s, 256", get(moe, "decode_256", "decode_tok_per_s"), "", None, "{:,.0f}"),
    ]  # fmt: skip
    print(
        f"\nissue 11 on {engine.get('device') or http.get('setup', {}).get('device', '?')} (files in {folder})"
    )
    print(f"| {'measure':<46} | {'value':>10} | {'target':>9} | met |")
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 11}|-----|")
    for name, value, op, target, fmt in rows:
        shown = fmt.format(value) if value is not None else "-"
        goal = f"{op} {fmt.format(target)}" if target is not None else ""
        met = (
            ""
            if target is None or value is None
            else ("yes" if (value >= target if op == ">=" else value <= target) else "NO")
        )
        print(f"| {name:<46} | {shown:>10} | {goal:>9} | {met:>3} |")
    if fp8:
        print(
            f"FP8 kernels the engines ran: {fp8.get('kernels')}; "
            f"matmul totals (µs): {fp8.get('matmul_total_us')}"
        )


if __name__ == "__main__":
    main()
