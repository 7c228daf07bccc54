"""The one-pass sampling kernel (engine/triton_sample.py) against its pre-change version, on one GPU.

    python3 benchmarks/sample_kernel.py [--sweep]

Times `fused_sample` (partial + combine kernels, replayed in a CUDA graph by
triton.testing.do_bench_cudagraph) for 64 and 256 rows of the Qwen3 vocabulary (151,936) in
bf16 and fp32 at temperature 1, one greedy batch and one batch of mixed temperatures; prints
microseconds per call and the GB/s of logits read, for the old kernels (copied below as the
pre-change reference) and the new ones. Then checks that both draw the same token ids for the
same inputs and seeds. At T = 1 and greedy the two compute the same score bits, so a mismatch
can only be an exact float tie of the two tokens' race scores (recomputed in torch); at other
temperatures the new x * (1/T) may differ from the old x / T in the last bit, so a near tie
(1e-6 relative) is also possible. Exits 1 on any other mismatch.

--sweep also times the new kernel over its launch parameters (triton_sample.BLOCK, NUM_WARPS,
PROGRAMS) at 64 and 256 rows, bf16, temperature 1. Without CUDA it says so and exits.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.inference.engine import triton_sample  # noqa: E402
from tandem.inference.engine.sampler import fmix32, sample_key, uniform_noise  # noqa: E402

VOCAB = 151_936


# ---- pre-change reference: triton_sample.py's kernels and launch as of commit 33421ee, names
# prefixed with _old / old_ ----
OLD_SPLITS = 16
OLD_BLOCK = 1024


@triton.jit
def _old_fmix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["step_seed"])
def _old_partial_kernel(
    logits_ptr, stride, temps_ptr, keys_ptr, positions_ptr, step_seed, vocab,
    max_ptr, sum_ptr, best_ptr, index_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0.0
    t_eff = tl.where(greedy, 1.0, temp)
    key = tl.load(keys_ptr + row)
    seeded = key >= 0
    unseeded_key = _old_fmix32(step_seed.to(tl.uint32) ^ _old_fmix32((row + 0x2545F491).to(tl.uint32)))
    key32 = tl.where(seeded, key.to(tl.uint32), unseeded_key)
    position = tl.load(positions_ptr + row).to(tl.uint32)
    row_hash = _old_fmix32(key32 ^ _old_fmix32(position))
    m = tl.full((), -1e30, tl.float32)
    total = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.zeros((), tl.int32)
    base = split * CHUNK
    for offset in range(0, CHUNK, BLOCK):
        cols = base + offset + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=valid, other=float("-inf"))
        x = x.to(tl.float32) / t_eff
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.where(valid, tl.exp(x - m_new), 0.0), axis=0)
        m = m_new
        h = row_hash + cols.to(tl.uint32) * 0x9E3779B9
        h = _old_fmix32(_old_fmix32(h) ^ row_hash)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(greedy, x, x - tl.log(-tl.log(u)))
        score = tl.where(valid, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0)
        better = block_best > best
        best_index = tl.where(better, base + offset + block_index, best_index)
        best = tl.maximum(best, block_best)
    out = row * SPLITS + split
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, total)
    tl.store(best_ptr + out, best)
    tl.store(index_ptr + out, best_index)


@triton.jit
def _old_combine_kernel(
    logits_ptr, stride, temps_ptr, max_ptr, sum_ptr, best_ptr, index_ptr, tokens_ptr, result_ptr, rows,
    SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    splits = row * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(max_ptr + splits)
    total = tl.load(sum_ptr + splits)
    best = tl.load(best_ptr + splits)
    index = tl.load(index_ptr + splits)
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(total * tl.exp(m - m_all), axis=0))
    token = tl.sum(tl.where(tl.arange(0, SPLITS) == tl.argmax(best, axis=0), index, 0), axis=0)
    temp = tl.load(temps_ptr + row)
    t_eff = tl.where(temp <= 0.0, 1.0, temp)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) / t_eff
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(result_ptr + row, token.to(tl.float64))
    tl.store(result_ptr + rows + row, (x - lse).to(tl.float64))


def old_fused_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    step_seed: int,
    tokens_out: torch.Tensor,
) -> torch.Tensor:
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    splits = min(OLD_SPLITS, triton.next_power_of_2(triton.cdiv(vocab, OLD_BLOCK)))
    chunk = OLD_BLOCK * triton.cdiv(triton.cdiv(vocab, splits), OLD_BLOCK)
    partial = torch.empty(3, rows * splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
    result = torch.empty(2, rows, dtype=torch.float64, device=logits.device)
    _old_partial_kernel[(rows, splits)](
        logits, logits.stride(0), temperatures, keys, positions, step_seed & 0x7FFFFFFF, vocab,
        partial[0], partial[1], partial[2], index,
        CHUNK=chunk, BLOCK=OLD_BLOCK, SPLITS=splits,
    )  # fmt: skip
    _old_combine_kernel[(rows,)](
        logits, logits.stride(0), temperatures, partial[0], partial[1], partial[2], index,
        tokens_out, result, rows, SPLITS=splits,
    )  # fmt: skip
    return result


# ---- end of the pre-change reference ----


def make_inputs(rows: int, dtype: torch.dtype, temps: list[float], seed: int) -> tuple:
    """Logits ~ N(0, 4²), every other row seeded (the rest take the step seed), random positions."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 4).to(dtype)
    temperatures = torch.tensor(temps, dtype=torch.float32, device="cuda")
    keys = torch.tensor([sample_key(seed, i) if i % 2 else -1 for i in range(rows)], device="cuda")
    positions = torch.randint(0, 32_768, (rows,), device="cuda", generator=gen)
    return logits, temperatures, keys, positions


def race_scores(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    step_seed: int,
    rows_: torch.Tensor,
    columns: torch.Tensor,
) -> torch.Tensor:
    """The race scores at (rows_[i], columns[i]), recomputed in torch (float32)."""
    key32 = torch.where(
        keys >= 0, keys, fmix32(step_seed ^ fmix32(torch.arange(len(keys), device="cuda") + 0x2545F491))
    )
    u = uniform_noise(key32[rows_], positions[rows_], VOCAB).gather(1, columns[:, None])[:, 0]
    temps = temperatures[rows_]
    x = logits[rows_].float().gather(1, columns[:, None])[:, 0] / torch.where(temps > 0, temps, 1.0)
    return torch.where(temps > 0, x - torch.log(-torch.log(u)), x)


def compare(name: str, inputs: tuple, step_seed: int) -> int:
    """Old and new ids and logprobs for the same inputs; returns the mismatches that are not ties
    (exact, or within 1e-6 relative where T is neither 0 nor 1)."""
    rows = inputs[0].shape[0]
    old_tokens, new_tokens = (torch.empty(rows, dtype=torch.int64, device="cuda") for _ in range(2))
    old = old_fused_sample(*inputs, step_seed, old_tokens)
    new = triton_sample.fused_sample(*inputs, step_seed, new_tokens)
    assert torch.equal(new[0].long(), new_tokens) and torch.equal(old[0].long(), old_tokens)
    differ = (old_tokens != new_tokens).nonzero()[:, 0]
    old_score = race_scores(*inputs, step_seed, differ, old_tokens[differ])
    new_score = race_scores(*inputs, step_seed, differ, new_tokens[differ])
    exact = old_score == new_score
    temps = inputs[1][differ]
    near = ~exact & (temps != 0) & (temps != 1) & ((old_score - new_score).abs() <= 1e-6 * old_score.abs())
    for r, a, b, sa, sb in zip(differ.tolist(), old_tokens[differ].tolist(), new_tokens[differ].tolist(),
                               old_score.tolist(), new_score.tolist(), strict=True):  # fmt: skip
        print(f"    {name} row {r}: old {a} (score {sa:.9g}), new {b} (score {sb:.9g})")
    lp = (old[1] - new[1]).abs().max().item()
    print(f"  {name:<40} mismatched ids {len(differ)} (exact ties {int(exact.sum())}, near ties "
          f"{int(near.sum())})   max |logprob old - new| {lp:.1e}")  # fmt: skip
    return len(differ) - int(exact.sum()) - int(near.sum())


def time_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="also time the new kernel's launch parameters")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/sample_kernel.py needs a CUDA device; nothing to do")
        return
    print(f"{torch.cuda.get_device_name()}; new kernel: BLOCK {triton_sample.BLOCK}, NUM_WARPS "
          f"{triton_sample.NUM_WARPS}, PROGRAMS {triton_sample.PROGRAMS}, MAX_SPLITS {triton_sample.MAX_SPLITS}")  # fmt: skip
    step_seed = 12345
    mixed = [0.0, 0.7, 1.0, 1.3]
    cases = [
        (f"{rows} rows {str(dtype)[6:]} T=1", rows, dtype, [1.0] * rows)
        for rows in (64, 256)
        for dtype in (torch.bfloat16, torch.float32)
    ]
    cases += [("256 rows bfloat16 greedy", 256, torch.bfloat16, [0.0] * 256)]
    cases += [("256 rows bfloat16 T=0/.7/1/1.3", 256, torch.bfloat16, [mixed[i % 4] for i in range(256)])]

    print(f"\n{'case':<32}{'old µs':>9}{'new µs':>9}{'speed-up':>10}{'old GB/s':>10}{'new GB/s':>10}")
    for name, rows, dtype, temps in cases:
        inputs = make_inputs(rows, dtype, temps, seed=rows)
        tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
        old_us = time_us(lambda: old_fused_sample(*inputs, step_seed, tokens))  # noqa: B023
        new_us = time_us(lambda: triton_sample.fused_sample(*inputs, step_seed, tokens))  # noqa: B023
        gb = inputs[0].numel() * inputs[0].element_size() / 1e9
        print(f"{name:<32}{old_us:>9.1f}{new_us:>9.1f}{old_us / new_us:>9.2f}x"
              f"{gb / old_us * 1e6:>10.0f}{gb / new_us * 1e6:>10.0f}")  # fmt: skip
    print("(64-row logits, 19-39 MB, fit in L2: repeated calls read them from there)")

    print("\nsame ids, old against new (4 seeds per case):")
    bad = 0
    for name, rows, dtype, temps in cases:
        for seed in range(4):
            bad += compare(
                f"{name} seed {seed}", make_inputs(rows, dtype, temps, seed=1000 + seed), step_seed + seed
            )
    print(f"mismatches other than ties: {bad}")

    if args.sweep:
        sweep(step_seed)
    if bad:
        sys.exit(1)


def sweep(step_seed: int) -> None:
    """The new kernel over its launch parameters, bf16, T = 1."""
    default = (triton_sample.BLOCK, triton_sample.NUM_WARPS, triton_sample.PROGRAMS)
    print(
        f"\nsweep (bf16, T=1; default {default}):\n{'BLOCK':>6}{'warps':>6}{'PROGRAMS':>9}{'64 rows µs':>12}{'256 rows µs':>13}"
    )
    inputs = {rows: make_inputs(rows, torch.bfloat16, [1.0] * rows, seed=rows) for rows in (64, 256)}
    tokens = torch.empty(256, dtype=torch.int64, device="cuda")
    for block, warps in [(128, 1), (256, 1), (256, 2), (512, 1), (512, 2), (512, 4), (1024, 4), (1024, 8)]:
        for programs in (2048, 4096, 8192, 16384):
            triton_sample.BLOCK, triton_sample.NUM_WARPS, triton_sample.PROGRAMS = block, warps, programs
            times = [
                time_us(lambda r=rows: triton_sample.fused_sample(*inputs[r], step_seed, tokens[:r]))
                for rows in (64, 256)
            ]
            print(f"{block:>6}{warps:>6}{programs:>9}{times[0]:>12.1f}{times[1]:>13.1f}")
    triton_sample.BLOCK, triton_sample.NUM_WARPS, triton_sample.PROGRAMS = default


if __name__ == "__main__":
    main()
