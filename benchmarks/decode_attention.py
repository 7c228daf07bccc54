"""The engine's paged decode-attention kernel (engine/triton_decode.py) on CUDA: its launch
parameters swept at the Qwen3-0.6B shape (16 query heads, 8 KV heads of 128, 16-token blocks)
or another head layout, bandwidth of the keys and values read, the fastest first.

    python3 benchmarks/decode_attention.py                   # batch 256, context 256; the best again at 64 / 128 / 384
    python3 benchmarks/decode_attention.py --batch 64 --context 384 --top 10
    python3 benchmarks/decode_attention.py --heads 32 --batch 64 256 --context 160 320   # Qwen3-8B's heads, each pair swept
    python3 benchmarks/decode_attention.py --heads 32 --batch 8 64 256 --context 320 4096 --splits 1 2 4 8 16

The sweep runs each configuration with the kernel's default split count ("auto": from the batch
and the KV-head groups, engine/triton_decode.py's decode_splits); the best of each sweep is then
timed at every count of --splits (1: the single kernel, more: split-KV and the combine kernel).
Each configuration is checked against the gather + SDPA path before it is timed; the cache's
blocks are a random permutation (as a long-running engine's are). Times are medians of
triton.testing.do_bench.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 16  # the defaults: Qwen3-0.6B's attention


def candidates() -> list[dict]:
    """Launch parameters worth timing: more KV heads per program want more warps, fewer tokens."""
    grids = {  # (one KV head per program: 64 / 2 warps / 3 stages won a wider sweep on 2026-12-01)
        1: dict(BLOCK_N=(32, 64, 128), num_warps=(2, 4), num_stages=(2, 3), KV_HEAD_FASTEST=(False, True)),
        2: dict(BLOCK_N=(32, 64), num_warps=(2, 4), num_stages=(3,), KV_HEAD_FASTEST=(False, True)),
        4: dict(BLOCK_N=(16, 32, 64), num_warps=(4, 8), num_stages=(2, 3), KV_HEAD_FASTEST=(True,)),
        8: dict(BLOCK_N=(16, 32), num_warps=(4, 8), num_stages=(1, 2), KV_HEAD_FASTEST=(False,)),
    }
    out = []
    for heads, grid in grids.items():
        for values in itertools.product(*grid.values()):
            out.append({"HEADS": heads, **dict(zip(grid, values, strict=True))})
    return out


def inputs(batch: int, context: int, heads: int = HEADS, kv_heads: int = KV_HEADS, seed: int = 0) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // BLOCK)
    blocks = batch * pages + 1
    k_cache, v_cache = torch.randn(
        2, blocks, BLOCK, kv_heads, DIM, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    q = torch.randn(batch, heads, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = (torch.randperm(blocks - 1, device="cuda", generator=gen) + 1).view(batch, pages)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens


def time_configs(
    configs: list[dict], batch: int, context: int, heads: int = HEADS, kv_heads: int = KV_HEADS
) -> list[dict]:
    import triton

    from tandem.inference.engine.attention import decode_attention
    from tandem.inference.engine.triton_decode import paged_decode_attention

    q, k_cache, v_cache, tables, lens = inputs(batch, context, heads, kv_heads)
    scale = DIM**-0.5
    ref = decode_attention(q[:8].float(), k_cache.float(), v_cache.float(), tables[:8], lens[:8], scale)
    gigabytes = 2 * batch * context * kv_heads * DIM * 2 / 1e9
    rows = []
    for config in configs:
        try:
            out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, config)
            err = (out[:8].float() - ref).abs().max().item()
            if err > 2e-2:
                print(f"wrong: {config} max error {err:.3g}", flush=True)
                continue
            us = 1e3 * triton.testing.do_bench(
                lambda c=config: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, c),
                warmup=20, rep=60, return_mode="median",
            )  # fmt: skip
        except Exception as e:  # a configuration the compiler or the device refuses
            print(f"skip {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rows.append({**config, "us": us, "TB/s": gigabytes / us * 1e3})
    rows.sort(key=lambda r: r["us"])
    return rows


def show(rows: list[dict], title: str, top: int) -> None:
    print(f"\n{title}")
    print("| HEADS | KV_HEAD_FASTEST | BLOCK_N | warps | stages | splits | µs | TB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows[:top]:
        print(
            f"| {r['HEADS']} | {r['KV_HEAD_FASTEST']} | {r['BLOCK_N']} | {r['num_warps']} | {r['num_stages']} "
            f"| {r.get('splits', 'auto')} | {r['us']:.1f} | {r['TB/s']:.2f} |"
        )


def time_splits(rows: list[dict], splits: list[int], batch: int, context: int, **shape: int) -> list[dict]:
    """The fastest configuration of a sweep (`rows`, the fastest first) again at each split count."""
    best = {k: v for k, v in rows[0].items() if k not in ("us", "TB/s")}
    again = time_configs([{**best, "splits": n} for n in splits], batch, context, **shape)
    show(again, f"batch {batch}, context {context}: the fastest at each split count", len(again))
    return again


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--context", type=int, nargs="+", default=[256])
    parser.add_argument("--heads", type=int, default=HEADS, help="query heads (Qwen3-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument(
        "--splits", type=int, nargs="+", default=[1, 2, 4, 8], help="split counts (powers of two)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_attention.py times a CUDA kernel: no GPU here")
        return
    from tandem.inference.engine.triton_decode import CONFIG

    default = dict(CONFIG)
    shape = dict(heads=args.heads, kv_heads=args.kv_heads)
    results = {}
    if len(args.batch) == len(args.context) == 1:  # one sweep, its best three again at other sizes
        swept_batch, swept_context = args.batch[0], args.context[0]
        rows = time_configs(candidates(), swept_batch, swept_context, **shape)
        show(rows, f"batch {swept_batch}, context {swept_context} (default {default})", args.top)
        results["sweep"] = rows
        results["splits"] = time_splits(rows, args.splits, swept_batch, swept_context, **shape)
        best = [{k: v for k, v in r.items() if k not in ("us", "TB/s")} for r in rows[:3]]
        for batch, context in ((swept_batch, 128), (swept_batch, 384), (64, swept_context)):
            again = time_configs([default, *best], batch, context, **shape)
            show(again, f"batch {batch}, context {context}: the default and the best three", 4)
            results[f"{batch}x{context}"] = again
    else:  # a sweep at every (batch, context), and where the default stands in it
        for batch, context in itertools.product(args.batch, args.context):
            rows = time_configs(candidates(), batch, context, **shape)
            show(rows, f"batch {batch}, context {context}, {args.heads}/{args.kv_heads} heads", args.top)
            mine = [r for r in rows if all(r[k] == v for k, v in default.items())]
            if mine:
                print(
                    f"default {default}: {mine[0]['us']:.1f} µs, rank {rows.index(mine[0]) + 1} of {len(rows)}"
                )
            results[f"{batch}x{context}"] = rows
            results[f"{batch}x{context} splits"] = time_splits(rows, args.splits, batch, context, **shape)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
