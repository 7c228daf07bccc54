"""Peak memory and time of one SFT forward/backward with a large vocabulary: the loss through the
full [tokens, vocab] logits (what SFT did before) against the chunked output head it uses now.

    python benchmarks/sft_memory.py [--vocab 151936 --rows 2 --seq-len 2048 --hidden 256 --layers 2]

Each variant runs in a fresh process on the same random model and batch. On CUDA the figure is
torch's peak allocated memory; on CPU, the process's peak resident set (which includes the
model and the Python runtime, the same for both).
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def one_step(model_dir: str, variant: str, rows: int, seq_len: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from tandem.trainer.logprobs import attach_sequence_logprobs
    from tandem.trainer.packing import MicroBatch
    from tandem.trainer.sft.train import token_loss_sum

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    attach_sequence_logprobs(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, seq_len), generator=gen).to(device)
    batch = MicroBatch(
        ids, torch.arange(seq_len).repeat(rows, 1).to(device), torch.ones_like(ids, dtype=torch.bool)
    )
    times = []
    for _ in range(3):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if variant == "full":
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            mask = batch.loss_mask[:, 1:]
            loss = F.cross_entropy(
                logits[:, :-1][mask].float(), batch.input_ids[:, 1:][mask], reduction="sum"
            )
        else:
            loss = token_loss_sum(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del loss
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return {"peak_gib": peak, "seconds": min(times[1:]), "device": device.type}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_step(args.child[0], args.child[1], args.rows, args.seq_len)))
        return

    from tandem.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            out=Path(tmp) / "m", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers
        )
        results = {}
        for variant in ("full", "chunked"):
            child = [sys.executable, __file__, "--rows", str(args.rows), "--seq-len", str(args.seq_len)]
            out = subprocess.run(
                [*child, "--child", str(model), variant], capture_output=True, text=True, check=True
            )
            results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    device = results["full"]["device"]
    tokens = args.rows * args.seq_len
    print(
        f"one SFT step: {tokens} tokens, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {device}"
    )
    print("| loss | peak memory (GiB) | seconds / step |")
    print("|---|---|---|")
    for variant, r in results.items():
        print(f"| {variant} | {r['peak_gib']:.2f} | {r['seconds']:.2f} |")
    full, chunked = results["full"], results["chunked"]
    print(
        f"chunked / full: memory {chunked['peak_gib'] / full['peak_gib']:.2f}x, time {chunked['seconds'] / full['seconds']:.2f}x"
    )


if __name__ == "__main__":
    main()
