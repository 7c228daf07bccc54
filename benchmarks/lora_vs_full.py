"""LoRA against full training at Qwen3-1.7B and Qwen3-4B shapes (random init) on one GPU: the
trainer's peak memory and step time, and the weight-update time to a native server beside it.

    PYTHONPATH=src python3 benchmarks/lora_vs_full.py                      # 1.7b and 4b, all variants
    PYTHONPATH=src python3 benchmarks/lora_vs_full.py --shapes 1.7b --variants full,lora
    uv run python benchmarks/lora_vs_full.py --device cpu --shapes tiny --steps 2   # a CPU smoke run

Each (shape, variant) runs in a fresh process: the RL trainer's model setup (tandem's Qwen3,
FSDP2 on one rank, torch.compile per block on CUDA, fused AdamW), `--steps` timed optimizer steps
(after two warm-ups) on random packed rows of `--rows` × `--tokens` tokens with a stand-in loss
(the mean logprob: the loss itself costs nothing next to the forward and backward), then the
weight update measured as benchmarks/weight_sync.py does (a real `inference` server on the same
GPU; colocated, then the filesystem): from the end of an optimizer step until the server answers
/update_weights with the new version. Variants:

    full      fp32 weights, bf16 compute (the default), every parameter trains; updates carry the model
    lora      bf16 frozen base, fp32 rank-`--rank` adapters on every attention and MLP projection;
              updates carry the adapters, which the server merges onto its base
    lora_ac   lora with full activation checkpointing

Peak memory is torch's peak allocated over the timed steps (weights, gradients, optimizer state
and activations); the table goes to stdout and, as JSON lines, to --out.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import SHAPES, Server, Trainer, build_model, timed_updates  # noqa: E402

from tandem.models.tiny import QWEN3_0_6B_SHAPE  # noqa: E402
from tandem.models.tokenizer import train_tokenizer  # noqa: E402
from tandem.net import free_port  # noqa: E402

QWEN3_4B_SHAPE = {
    **QWEN3_0_6B_SHAPE,
    "hidden_size": 2560,
    "num_layers": 36,
    "num_heads": 32,
    "num_kv_heads": 8,
    "intermediate_size": 9728,
}
"""Qwen3-4B's shape: 36 layers, 32 query / 8 KV heads of 128, MLP 9728, tied 151,936-row embedding."""
SHAPES["4b"] = QWEN3_4B_SHAPE  # weight_sync.build_model reads its shapes from this dict


def variant_overrides(variant: str, rank: int, cuda: bool) -> list[tuple[str, object]]:
    lora = [("model.dtype", "bfloat16" if cuda else "float32"), ("lora.rank", rank), ("lora.alpha", 2 * rank)]
    return {
        "full": [("optim.lr", 1e-6)],
        "lora": lora,
        "lora_ac": [*lora, ("parallel.activation_checkpointing", "full")],
    }[variant]


def child(args: argparse.Namespace) -> None:
    """One (shape, variant): train, then time the weight updates; one JSON line to args.result."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    work = Path(args.work)
    model = work / f"model_{args.shape}"
    trainer = Trainer(
        model, args.device, work / "fs", tuple(variant_overrides(args.variant, args.rank, cuda))
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    for _ in range(2):
        trainer.step(args.rows, args.tokens)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.step(args.rows, args.tokens)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    step_s = statistics.median(times)
    result = {
        "shape": args.shape,
        "variant": args.variant,
        "trainable (M)": round(trainable / 1e6, 1),
        "peak GiB": round(peak, 2),
        "step s": round(step_s, 3),
        "tokens/s": round(args.rows * args.tokens / step_s),
    }
    dtype = "bfloat16" if cuda else "float32"
    tokenizer = train_tokenizer()
    settings = argparse.Namespace(poll_ms=2.0, busy=0)
    version = 1
    for transport, updates in (("colocated", args.updates), ("filesystem", 2)):
        port = free_port()
        server = Server.start(transport, model, "0" if cuda else None, transport, port, work, dtype)
        try:
            server.wait_healthy()
            run_dir = work / f"{args.variant}_{transport}"
            timings = timed_updates(
                trainer, server, transport, port, run_dir, version, updates, settings, tokenizer
            )
            version += updates + 1
            result[f"{transport} update ms"] = round(1000 * statistics.median(t["total"] for t in timings), 1)
        finally:
            server.stop()
    Path(args.result).write_text(json.dumps(result))


COLUMNS = ["shape", "variant", "trainable (M)", "peak GiB", "step s", "tokens/s", "colocated update ms", "filesystem update ms"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="1.7b,4b", help=f"Comma-separated, of {', '.join(SHAPES)}.")
    parser.add_argument("--variants", default="full,lora,lora_ac")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (alpha = 2 × rank).")
    parser.add_argument("--rows", type=int, default=2, help="Packed rows per step.")
    parser.add_argument("--tokens", type=int, default=4096, help="Tokens per row.")
    parser.add_argument("--steps", type=int, default=5, help="Timed optimizer steps.")
    parser.add_argument("--updates", type=int, default=3, help="Timed colocated weight updates.")
    parser.add_argument("--timeout", type=float, default=900, help="Seconds per (shape, variant).")
    parser.add_argument("--out", type=Path, default=Path("lora_vs_full.jsonl"))
    parser.add_argument("--child", nargs=3, metavar=("SHAPE", "VARIANT", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.shape, args.variant, args.result = args.child
        child(args)
        return
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
    with tempfile.TemporaryDirectory() as tmp, args.out.open("a") as out:
        work = Path(tmp)
        for shape in args.shapes.split(","):
            build_model(shape, work / f"model_{shape}", torch.device(args.device))
            for variant in args.variants.split(","):
                result = work / f"{shape}_{variant}.json"
                command = [sys.executable, __file__, "--child", shape, variant, str(result), "--work", tmp]
                command += ["--device", args.device, "--rank", str(args.rank), "--rows", str(args.rows)]
                command += [
                    "--tokens",
                    str(args.tokens),
                    "--steps",
                    str(args.steps),
                    "--updates",
                    str(args.updates),
                ]
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                    failure = (
                        None
                        if done.returncode == 0
                        else (done.stdout + done.stderr).strip().splitlines()[-1:]
                    )
                except subprocess.TimeoutExpired:
                    failure = [f"timed out after {args.timeout:g} s"]
                row = (
                    json.loads(result.read_text())
                    if failure is None
                    else {"shape": shape, "variant": variant, "peak GiB": f"failed: {failure}"}
                )
                out.write(json.dumps(row) + "\n")
                print("| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |", flush=True)


if __name__ == "__main__":
    main()
