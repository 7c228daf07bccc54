"""Long sequences on one GPU: the longest that trains, and tokens/s at 16k, 32k and 64k tokens,
per memory setting, for the SFT and the RL trainer at Qwen3-0.6B, 1.7B and 4B shapes.

    python3 benchmarks/long_context.py                        # all of it; rerun until it says "all done"
    python3 benchmarks/long_context.py --shapes 0.6b --settings full,selective --trainers sft

Each (shape, setting, trainer) runs in its own process: it builds the trainer's model
(trainer/model.py: fp32 weights, bf16 compute under FSDP2, torch.compile per block, flex
attention, the chunked output head; random init, vocabulary 151,936) with the setting's
`[trainer.parallel]` keys, and trains one packed row holding one document of L tokens, for L in
LENGTHS (4k … 512k) up to --max-len (default 128k), in turn, until one does not fit. A length
trains when a whole optimizer step (forward, backward, clipping, AdamW) finishes; the longest is
the last that did, below the first that ran out of memory (so the answer is bracketed by the
grid). A length whose step would take longer than --max-step-s (default 30 s; predicted from the
last step as growing with the square of the length, which bounds attention-dominated steps) is
not tried: the row says "time cap" and the answer is a lower bound. 4k and 8k are there to
compile (the second shape recompiles with dynamic shapes; later lengths reuse it).

- settings: `none`, `full` and `selective` activation checkpointing, `offload` (activations in
  pinned host memory, no checkpointing), `full+offload` (full checkpointing, each block's input
  in pinned host memory).
- sft: trainer/sft/train.py's loss (`token_loss_sum`, loss on every token) and step.
- rl: trainer/rl/train.py's `train_step` on the orchestrator's packing of one sample (a
  256-token prompt, the rest completion, sampler logprobs near the random model's).

Tokens/s: the second of two steps at 16k, 32k and 64k (the first may still compile); one step
elsewhere. MFU counts 6·N·T + 6·L·d·T² per document as benchmarks/trainer_mfu.py does (recompute not
counted). Peak GPU memory is torch's max allocated at that length; host memory is the drop of
MemAvailable during the length's steps. With offload, a length whose host memory (extrapolated
linearly from the previous length) would pass 80% of what is available is not tried ("host
memory").

Rows go to --out (JSONL) as they are measured; a rerun skips the combinations already done, and
each run starts no new combination after --budget-s seconds (default 540, to fit one 10-minute
device command) and kills the one running then (the next run goes on after the lengths it had
measured). Every run ends with the table of everything measured so far.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_mfu import PEAK_FLOPS, hf_config, step_flops  # noqa: E402

K = 1024
LENGTHS = [4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 96 * K, 128 * K, 192 * K, 256 * K, 384 * K, 512 * K]
TIMED = (16 * K, 32 * K, 64 * K)  # tokens/s reported here
SETTINGS = {
    "none": {},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "offload": {"activation_offload": True},
    "full+offload": {"activation_checkpointing": "full", "activation_offload": True},
}
SHAPE_NAMES = ("0.6b", "1.7b", "4b")
PROMPT = 256


def mem_available() -> int:
    """Bytes of host memory available now (/proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class HostWatch:
    """The largest drop of MemAvailable while active (sampled every 50 ms)."""

    def __enter__(self) -> "HostWatch":
        self.start = self.low = mem_available()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.low = min(self.low, mem_available())
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()

    @property
    def used(self) -> int:
        return self.start - self.low


def build(shape: str, setting: str):  # noqa: ANN201 (model, world, parallel config)
    from tandem.config.base import ModelConfig
    from tandem.trainer.config import ParallelConfig
    from tandem.trainer.model import build_trainer_model
    from tandem.trainer.parallel import init_distributed

    world = init_distributed("cuda")
    parallel = ParallelConfig(**SETTINGS[setting])
    with tempfile.TemporaryDirectory() as tmp:
        hf_config(shape).save_pretrained(Path(tmp) / "config")
        model = build_trainer_model(
            ModelConfig(name=str(Path(tmp) / "config")), world, parallel, load_weights=False
        )
    model.init_weights()
    return model, world, parallel


def sft_step(model, optimizer, world, length: int):  # noqa: ANN001, ANN201 (a step function)
    from tandem.trainer.optim import clip_grad_norm
    from tandem.trainer.packing import MicroBatch
    from tandem.trainer.sft.train import token_loss_sum

    vocab = model.hf_config.vocab_size
    ids = torch.randint(0, vocab, (1, length), device=world.device)
    positions = torch.arange(length, device=world.device)[None]
    batch = MicroBatch(ids, positions, positions > 0)

    def step() -> None:
        (token_loss_sum(model, batch) * (world.size / (length - 1))).backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def rl_step(model, optimizer, world, length: int, parallel):  # noqa: ANN001, ANN201 (a step function)
    import math

    from tandem.trainer.rl.config import RLTrainerConfig
    from tandem.trainer.rl.loss import build_objective
    from tandem.trainer.rl.train import train_step
    from tandem.transport.rollouts import Sample, pack_samples

    vocab = model.hf_config.vocab_size
    cfg = RLTrainerConfig(parallel=parallel)
    objective = build_objective(cfg.loss)
    generator = torch.Generator().manual_seed(length)
    completion = length - PROMPT
    sample = Sample(
        prompt_ids=torch.randint(0, vocab, (PROMPT,), generator=generator).tolist(),
        completion_ids=torch.randint(0, vocab, (completion,), generator=generator).tolist(),
        completion_mask=[True] * completion,
        completion_logprobs=(-math.log(vocab) + 0.1 * torch.randn(completion, generator=generator)).tolist(),
        reward=1.0,
        advantage=0.5,
        policy_version=0,
    )
    (micro_batches,) = pack_samples([sample], length, 1, length)

    def step() -> None:
        train_step(model, objective, optimizer, micro_batches, 0, cfg, world)

    return step


def append_row(out: Path, combo: tuple[str, str, str], **row: object) -> None:
    shape, setting, trainer = combo
    with out.open("a") as f:
        f.write(json.dumps({"shape": shape, "setting": setting, "trainer": trainer, **row}) + "\n")


def run_combo(
    shape: str,
    setting: str,
    trainer: str,
    lengths: list[int],
    out: Path,
    max_step_s: float,
    last: tuple[int, float] | None,
) -> None:
    """The child: each of `lengths` in turn until one fails; one JSON row each, then "done".

    `last` is (length, step seconds) of the longest length an earlier run measured, for the time cap.
    """
    from tandem.trainer.config import OptimConfig
    from tandem.trainer.optim import build_optimizer

    def record(**row: object) -> None:
        append_row(out, (shape, setting, trainer), **row)

    model, world, parallel = build(shape, setting)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-5))
    config = model.hf_config
    host_per_token = None
    if "offload" in setting and lengths and lengths[0] > LENGTHS[0]:
        lengths = [LENGTHS[0], *lengths]  # (a resumed run) calibrates the host memory per token
    for length in lengths:
        available = mem_available()
        if host_per_token is not None and host_per_token * length > 0.8 * available:
            record(length=length, status="host memory", host_gib=host_per_token * length / 2**30)
            break
        predicted = None if last is None else last[1] * (length / last[0]) ** 2
        if predicted is not None and predicted > max_step_s:
            record(length=length, status="time cap", predicted_step_s=predicted)
            break
        make = sft_step if trainer == "sft" else rl_step
        step = make(model, optimizer, world, length, *([parallel] if trainer == "rl" else []))
        steps = 2 if length in TIMED else 1
        times = []
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with HostWatch() as host:
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
        except Exception as e:  # out of GPU memory, or anything else: the row says which
            status = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
            record(length=length, status=status, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            break
        host_per_token = host.used / length
        seconds = times[-1]
        if length >= TIMED[0]:  # below it a step may still compile, so it predicts nothing
            last = (length, seconds)
        record(
            length=length,
            status="ok",
            step_s=seconds,
            tokens_per_s=length / seconds if steps > 1 else None,
            mfu=step_flops(config, [length]) / seconds / PEAK_FLOPS if steps > 1 else None,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            host_gib=host.used / 2**30,
            first_step_s=times[0],
        )
    record(status="done")


def load_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def print_table(rows: list[dict]) -> None:
    latest: dict[tuple, dict] = {}
    for r in rows:
        latest[(r["shape"], r["setting"], r["trainer"], r.get("length"))] = r
    combos = sorted(
        {k[:3] for k in latest}, key=lambda k: (SHAPE_NAMES.index(k[0]), list(SETTINGS).index(k[1]), k[2])
    )
    print("\n| shape | setting | trainer | longest that trains | first that does not | "
          "16k tok/s (MFU, GiB) | 32k tok/s (MFU, GiB) | 64k tok/s (MFU, GiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for combo in combos:
        measured = sorted(
            (r for k, r in latest.items() if k[:3] == combo and k[3]), key=lambda r: r["length"]
        )
        trained = [r for r in measured if r["status"] == "ok"]
        failed = next((r for r in measured if r["status"] != "ok"), None)
        done = (*combo, None) in latest
        bound = "≥ " if (done and not failed) or (failed and failed["status"] == "time cap") else ""
        longest = f"{bound}{trained[-1]['length'] // K}k" if trained else f"< {LENGTHS[0] // K}k"
        beyond = (
            f"{failed['length'] // K}k not tried (a step ≈ {failed['predicted_step_s']:.0f} s)"
            if failed and failed["status"] == "time cap"
            else f"{failed['length'] // K}k ({failed['status']})"
            if failed
            else ("(grid end)" if done else "(unfinished)")
        )
        cells = []
        for n in TIMED:
            r = next((r for r in trained if r["length"] == n and r.get("tokens_per_s")), None)
            cells.append(
                f"{r['tokens_per_s']:,.0f} ({100 * r['mfu']:.1f}%, {r['peak_gib']:.0f})" if r else "—"
            )
        print(f"| {combo[0]} | {combo[1]} | {combo[2]} | {longest} | {beyond} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPE_NAMES))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--trainers", default="sft,rl")
    parser.add_argument("--max-len", type=int, default=128 * K, help="longest length tried (tokens)")
    parser.add_argument(
        "--max-step-s", type=float, default=30.0, help="longest step a length may take (seconds)"
    )
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "long_context.jsonl")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--from-len", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--last", help=argparse.SUPPRESS)  # "length:step seconds" measured before
    args = parser.parse_args()
    if args.one:
        shape, setting, trainer = args.one.split(":")
        lengths = [n for n in LENGTHS if args.from_len <= n <= args.max_len]
        last = tuple(float(x) for x in args.last.split(":")) if args.last else None
        run_combo(shape, setting, trainer, lengths, args.out, args.max_step_s, last)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    combos = [
        (shape, setting, trainer)
        for shape in args.shapes.split(",")
        for setting in args.settings.split(",")
        for trainer in args.trainers.split(",")
    ]
    rows = load_rows(args.out)
    done = {(r["shape"], r["setting"], r["trainer"]) for r in rows if r["status"] == "done"}
    left = [c for c in combos if c not in done]
    for combo in left:
        remaining = deadline - time.monotonic()
        if remaining < 60:
            break
        # a combination stopped by an earlier run's budget goes on after the lengths it measured
        measured = [
            r for r in rows if (r["shape"], r["setting"], r["trainer"]) == combo and r["status"] == "ok"
        ]
        last = max(measured, key=lambda r: r["length"], default=None)
        start = min((n for n in LENGTHS if n > (last["length"] if last else 0)), default=args.max_len + 1)
        if start > args.max_len:
            append_row(args.out, combo, status="done")
            continue
        print(f"== {':'.join(combo)} from {start // K}k", flush=True)
        command = [sys.executable, __file__, "--one", ":".join(combo), "--max-len", str(args.max_len)]
        command += ["--from-len", str(start), "--max-step-s", str(args.max_step_s)]
        command += ["--last", f"{last['length']}:{last['step_s']}"] if last else []
        try:
            subprocess.run([*command, "--out", str(args.out)], check=False, timeout=remaining)
        except subprocess.TimeoutExpired:
            print(f"   stopped at the time budget; {':'.join(combo)} is redone on the next run", flush=True)
            break
    rows = load_rows(args.out)
    print_table(rows)
    finished = {(r["shape"], r["setting"], r["trainer"]) for r in rows if r["status"] == "done"}
    missing = [c for c in combos if c not in finished]
    print("all done" if not missing else f"{len(missing)} of {len(combos)} left: run the same command again")


if __name__ == "__main__":
    main()
