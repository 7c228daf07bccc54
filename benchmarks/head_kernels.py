"""The chunked output head's per-chunk kernels on one GPU: one-pass Triton against torch.compile.

    python benchmarks/head_kernels.py [--rows 4096] [--vocab 151936] [--hidden 1024]

One chunk of bf16 logits [rows, vocab] (the training path's shape at the Qwen3 vocabulary):
the softmax statistics (forward) and the logit gradient (backward) each, then the whole
`chunked_logprobs` forward + backward over 4 chunks (head matmuls included), recomputing the
logits in the backward and keeping them. Prints a table of
milliseconds (median of 20 after 3 warm-ups, CUDA events), the bytes each kernel must move and
the bandwidth that implies, and checks that the two implementations agree.
"""

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.models.layers import chunked_head, triton_head  # noqa: E402


def time_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows, vocab = args.rows, args.vocab
    logits = torch.randn(rows, vocab, device=device, generator=gen).mul_(3).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    g_lp, g_ent = (
        torch.randn(rows, device=device, generator=gen),
        torch.randn(rows, device=device, generator=gen),
    )
    compiled_stats = torch.compile(chunked_head.token_stats, dynamic=True)
    compiled_grad = torch.compile(chunked_head.logit_grad, dynamic=True)

    want = compiled_stats(logits, targets, 0.9)
    got = triton_head.token_stats(logits, targets, 0.9)
    stats_error = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    _, ent, lse = want
    grad_want = compiled_grad(logits, targets, lse, ent, g_lp, g_ent, 0.9).float()
    grad_got = triton_head.logit_grad(logits.clone(), targets, lse, ent, g_lp, g_ent, 0.9).float()
    grad_error = float((grad_got - grad_want).abs().max() / grad_want.abs().max())

    one_read = logits.numel() * logits.element_size()
    scratch = logits.clone()
    rows_out = [
        ("stats", "compiled", time_ms(lambda: compiled_stats(logits, targets, 0.9)), one_read),
        ("stats", "triton", time_ms(lambda: triton_head.token_stats(logits, targets, 0.9)), one_read),
        ("grad", "compiled", time_ms(lambda: compiled_grad(logits, targets, lse, ent, g_lp, g_ent, 0.9)), 2 * one_read),
        ("grad", "triton", time_ms(lambda: triton_head.logit_grad(scratch, targets, lse, ent, g_lp, g_ent, 0.9)),
         2 * one_read),
    ]  # fmt: skip

    hidden = torch.randn(4 * rows, args.hidden, device=device, generator=gen).bfloat16().requires_grad_()
    weight = (
        (torch.randn(vocab, args.hidden, device=device, generator=gen) * 0.02).bfloat16().requires_grad_()
    )
    head_targets = torch.randint(0, vocab, (4 * rows,), device=device, generator=gen)

    def head_step(keep: bool = False) -> None:
        lp, entropy = chunked_head.chunked_logprobs(hidden, weight, head_targets, 1.0, rows, keep_logits=keep)
        (lp.sum() + 0.01 * entropy.sum()).backward()

    triton_kernels = chunked_head._kernels
    for kernel, choose in (
        ("compiled", lambda *_: (compiled_stats, compiled_grad)),
        ("triton", triton_kernels),
    ):
        chunked_head._kernels = choose  # the head's per-chunk kernels, swapped for the baseline row
        rows_out.append((f"head fwd+bwd, {4 * rows} tokens", kernel, time_ms(head_step, 10), 0))
    chunked_head._kernels = triton_kernels
    rows_out.append(
        (f"head fwd+bwd, {4 * rows} tokens, logits kept", "triton", time_ms(lambda: head_step(True), 10), 0)
    )

    print(f"\nrows {rows}, vocab {vocab}, bf16 logits; stats max |diff| {stats_error:.2e}, "
          f"grad max rel diff {grad_error:.2e}\n")  # fmt: skip
    print("| kernel | implementation | ms | GB/s |")
    print("|---|---|---|---|")
    for name, impl, ms, nbytes in rows_out:
        rate = f"{nbytes / ms / 1e6:,.0f}" if nbytes else "–"
        print(f"| {name} | {impl} | {ms:.3f} | {rate} |")


if __name__ == "__main__":
    main()
