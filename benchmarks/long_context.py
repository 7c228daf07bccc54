"""Long sequences: the longest that trains, and tokens/s at 16k, 32k and 64k tokens, per memory
setting (one GPU) or context-parallel setting (two), for the SFT and the RL trainer at Qwen3-0.6B,
1.7B and 4B shapes.

    python3 benchmarks/long_context.py                        # all of it; rerun until it says "all done"
    python3 benchmarks/long_context.py --shapes 0.6b --settings full,selective --trainers sft

Each (shape, setting) runs in its own process: it builds the trainer's model (trainer/model.py:
fp32 weights, bf16 compute under FSDP2, torch.compile per block, flex attention, the chunked
output head; random init, vocabulary 151,936) with the setting's `[trainer.parallel]` keys, and
trains one packed row holding one document of L tokens, for L in LENGTHS (4k … 512k) up to
--max-len (default 128k), in turn, each trainer at each length (SFT, then RL: one model and one
compilation serve both), until one does not fit. A length trains when a whole optimizer step
(forward, backward, clipping, AdamW) finishes; the longest is the last that did, below the
first that ran out of memory (so the answer is bracketed by the grid). A failed step ends its
process (FSDP's state after an out-of-memory step is not trusted); a fresh one goes on with the
other trainer from the length it had reached. A length whose step would take longer than
--max-step-s (default 30 s; predicted from the last step as growing with the square of the
length, which bounds attention-dominated steps) is not tried: the row says "time cap" and the
answer is a lower bound. 4k and 8k are there to
compile (the second shape recompiles with dynamic shapes; later lengths reuse it).

- settings: `none`, `full` and `selective` activation checkpointing, `offload` (activations in
  pinned host memory, no checkpointing), `full+offload` (full checkpointing, each block's input
  in pinned host memory); `cp2` and `cp2-ring`: context parallelism over 2 GPUs (ulysses, ring;
  no checkpointing), the child launched by torchrun, the document shared by both ranks and each
  running half of its tokens (rank 0 records). Compare them with `none` on one GPU.
- sft: trainer/sft/train.py's loss (`token_loss_sum`, loss on every token) and step.
- rl: trainer/rl/train.py's `train_step` on the orchestrator's packing of one sample (a
  256-token prompt, the rest completion, sampler logprobs near the random model's).

Tokens/s: the second of two steps at 16k, 32k and 64k (the first may still compile); one step
elsewhere; for a cp setting the document's tokens over the step, all its GPUs together (MFU is per
GPU). MFU counts 6·N·T + 6·L·d·T² per document as benchmarks/trainer_mfu.py does (recompute not
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
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchrun import child_command, child_env  # noqa: E402
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
    # context parallelism: each runs on `cp` GPUs (torchrun), one document split over them
    "cp2": {"cp": 2},
    "cp2-ring": {"cp": 2, "cp_style": "ring"},
}
SHAPE_NAMES = ("0.6b", "1.7b", "4b")
PROMPT = 256
TRAINERS = ("sft", "rl")  # the order in which a length runs them


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


def gpus_of(setting: str) -> int:
    """GPUs a setting runs on: its cp group, or one."""
    return SETTINGS[setting].get("cp", 1)


def model_config(shape: str):  # noqa: ANN201 (a transformers config)
    if shape != "smoke":
        return hf_config(shape)
    from transformers import Qwen3Config

    return Qwen3Config(  # a CPU check of this script's flow (--device cpu --shapes smoke)
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=512 * K,
    )  # fmt: skip


def build(shape: str, setting: str, device: str):  # noqa: ANN201 (model, world, parallel config)
    from tandem.config.base import ModelConfig
    from tandem.trainer.config import ParallelConfig
    from tandem.trainer.model import build_trainer_model
    from tandem.trainer.parallel import init_distributed

    world = init_distributed(device)
    parallel = ParallelConfig(**SETTINGS[setting])
    with tempfile.TemporaryDirectory() as tmp:
        model_config(shape).save_pretrained(Path(tmp) / "config")
        model = build_trainer_model(
            ModelConfig(name=str(Path(tmp) / "config"), device=device), world, parallel, load_weights=False
        )
    model.init_weights()
    return model, world, parallel


def sft_step(model, optimizer, world, length: int):  # noqa: ANN001, ANN201 (a step function)
    from tandem.trainer.optim import clip_grad_norm
    from tandem.trainer.packing import MicroBatch
    from tandem.trainer.sft.train import token_loss_sum

    vocab = model.hf_config.vocab_size
    generator = torch.Generator().manual_seed(length)  # the same document on every rank (cp shares it)
    ids = torch.randint(0, vocab, (1, length), generator=generator).to(world.device)
    positions = torch.arange(length, device=world.device)[None]
    batch = MicroBatch(ids, positions, positions > 0)

    def step() -> None:
        (token_loss_sum(model, batch) * (world.size / (length - 1))).backward()
        clip_grad_norm(optimizer, 1.0)
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


def time_steps(step: Callable[[], None], steps: int, cuda: bool) -> tuple[list[float], int]:
    """Seconds of each of `steps` calls of `step`, and the host memory they took (bytes); peak GPU
    memory counts from here."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    with HostWatch() as host:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return times, host.used


def append_row(out: Path, combo: tuple[str, str, str], **row: object) -> None:
    shape, setting, trainer = combo
    with out.open("a") as f:
        f.write(json.dumps({"shape": shape, "setting": setting, "trainer": trainer, **row}) + "\n")


def run_group(
    shape: str,
    setting: str,
    plan: dict[str, dict],
    out: Path,
    max_len: int,
    max_step_s: float,
    device: str,
) -> None:
    """The child: each length in turn, each trainer of `plan` at it (from its "from" length on);
    one JSON row each, and "done" for a trainer at its first length that fails or is not tried.

    `plan[trainer]["last"]` is (length, step seconds) of the longest length an earlier run
    measured, for the time cap. A failed step ends the child: the parent starts a fresh one.
    """
    from tandem.trainer.config import OptimConfig
    from tandem.trainer.optim import build_optimizer

    model, world, parallel = build(shape, setting, device)

    def record(trainer: str, **row: object) -> None:
        if world.rank == 0:  # (under context parallelism every rank runs the same steps)
            append_row(out, (shape, setting, trainer), gpus=world.size, **row)

    cuda = world.device.type == "cuda"
    optimizer = build_optimizer(model, OptimConfig(lr=1e-5))
    config = model.hf_config
    first = min(p["from"] for p in plan.values())
    lengths = [n for n in LENGTHS if first <= n <= max_len]
    calibrate = "offload" in setting and lengths and lengths[0] > LENGTHS[0]
    if calibrate:
        lengths = [LENGTHS[0], *lengths]  # (a resumed run) measures the host memory per token again
    active = {t: {"last": p["last"], "from": p["from"], "host_per_token": None} for t, p in plan.items()}
    for length in lengths:
        for trainer in [t for t in TRAINERS if t in active]:
            state = active[trainer]
            if length < state["from"] and not (calibrate and length == LENGTHS[0]):
                continue
            host_per_token, last = state["host_per_token"], state["last"]
            predicted = None if last is None else last[1] * (length / last[0]) ** 2
            if host_per_token is not None and host_per_token * length > 0.8 * mem_available():
                record(trainer, length=length, status="host memory", host_gib=host_per_token * length / 2**30)
            elif predicted is not None and predicted > max_step_s:
                record(trainer, length=length, status="time cap", predicted_step_s=predicted)
            else:
                make = sft_step if trainer == "sft" else rl_step
                step = make(model, optimizer, world, length, *([parallel] if trainer == "rl" else []))
                steps = 2 if length in TIMED else 1
                try:
                    times, host_used = time_steps(step, steps, cuda)
                except Exception as e:  # out of GPU memory, or anything else: the row says which
                    status = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
                    error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    record(trainer, length=length, status=status, error=error)
                    record(trainer, status="done")
                    return
                state["host_per_token"] = host_used / length
                seconds = times[-1]
                if length >= TIMED[0]:  # below it a step may still compile, so it predicts nothing
                    state["last"] = (length, seconds)
                record(
                    trainer,
                    length=length,
                    status="ok",
                    step_s=seconds,
                    tokens_per_s=length / seconds if steps > 1 else None,  # over all its GPUs
                    mfu=step_flops(config, [length]) / seconds / PEAK_FLOPS / world.size
                    if steps > 1
                    else None,
                    peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                    host_gib=host_used / 2**30,
                    first_step_s=times[0],
                )
                continue
            record(trainer, status="done")  # (not tried: host memory or time cap)
            del active[trainer]
        if not active:
            return
    for trainer in active:
        record(trainer, status="done")


def load_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def print_table(rows: list[dict]) -> None:
    latest: dict[tuple, dict] = {}
    for r in rows:
        latest[(r["shape"], r["setting"], r["trainer"], r.get("length"))] = r
    combos = sorted(
        {k[:3] for k in latest},
        key=lambda k: ((SHAPE_NAMES + (k[0],)).index(k[0]), list(SETTINGS).index(k[1]), k[2]),
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
            peak = "—" if r is None or r["peak_gib"] is None else f"{r['peak_gib']:.0f}"  # (None on a CPU)
            cells.append(f"{r['tokens_per_s']:,.0f} ({100 * r['mfu']:.1f}%, {peak})" if r else "—")
        print(f"| {combo[0]} | {combo[1]} | {combo[2]} | {longest} | {beyond} | {' | '.join(cells)} |")


def plan_of(
    rows: list[dict], shape: str, setting: str, trainers: list[str], max_len: int, max_step_s: float
) -> dict[str, dict]:
    """For each trainer of (shape, setting) not done yet: the length to go on from (after the
    lengths an earlier run measured) and the longest timed step measured, for the time cap.
    A trainer that stopped at a time cap that this run's --max-step-s lifts goes on from there."""
    plan = {}
    for trainer in trainers:
        mine = [r for r in rows if (r["shape"], r["setting"], r["trainer"]) == (shape, setting, trainer)]
        cap = max((r for r in mine if r["status"] == "time cap"), key=lambda r: r["length"], default=None)
        failed = any(r["status"] in ("oom", "error", "host memory") for r in mine)
        trained = max((r["length"] for r in mine if r["status"] == "ok"), default=0)
        lifted = (
            cap is not None
            and not failed
            and cap["length"] > trained
            and cap["predicted_step_s"] <= max_step_s
        )
        if any(r["status"] == "done" for r in mine) and not lifted:
            continue
        measured = [r["length"] for r in mine if r["status"] == "ok"]
        start = min((n for n in LENGTHS if n > max(measured, default=0)), default=max_len + 1)
        timed = [r for r in mine if r["status"] == "ok" and r["length"] >= TIMED[0]]
        last = max(timed, key=lambda r: r["length"], default=None)
        plan[trainer] = {"from": start, "last": (last["length"], last["step_s"]) if last else None}
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPE_NAMES))
    parser.add_argument(
        "--settings",
        default=",".join(k for k, v in SETTINGS.items() if "cp" not in v),
        help="cp2, cp2-ring: 2 GPUs",
    )
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--max-len", type=int, default=128 * K, help="longest length tried (tokens)")
    parser.add_argument(
        "--max-step-s", type=float, default=30.0, help="longest step a length may take (seconds)"
    )
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "long_context.jsonl")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: with --shapes smoke
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: "shape:setting"
    parser.add_argument("--plan", help=argparse.SUPPRESS)  # the child: plan_of's answer, as JSON
    args = parser.parse_args()
    if args.one:
        shape, setting = args.one.split(":")
        run_group(shape, setting, json.loads(args.plan), args.out, args.max_len, args.max_step_s, args.device)
        return
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            parser.error(f"unknown setting {setting!r} (one of {', '.join(SETTINGS)})")
        gpus = gpus_of(setting)
        if args.device == "cuda" and torch.cuda.device_count() < gpus:
            parser.error(f"setting {setting} needs {gpus} GPUs; this machine has {torch.cuda.device_count()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    trainers = args.trainers.split(",")
    groups = [(shape, setting) for shape in args.shapes.split(",") for setting in args.settings.split(",")]
    stopped = False
    for shape, setting in groups:
        fruitless = 0
        while not stopped:
            rows = load_rows(args.out)
            plan = plan_of(rows, shape, setting, trainers, args.max_len, args.max_step_s)
            for trainer in [t for t, p in plan.items() if p["from"] > args.max_len]:
                append_row(args.out, (shape, setting, trainer), status="done")  # (the grid's end)
                del plan[trainer]
            remaining = deadline - time.monotonic()
            if not plan or remaining < 60 or fruitless == 2:
                stopped = bool(plan) and remaining < 60
                if plan and fruitless == 2:
                    print(f"   {shape}:{setting} made no progress twice: see its rows", flush=True)
                break
            froms = ", ".join(f"{t} from {p['from'] // K}k" for t, p in plan.items())
            print(f"== {shape}:{setting}: {froms}", flush=True)
            gpus = gpus_of(setting)
            command = [
                *child_command(__file__, gpus),
                "--one",
                f"{shape}:{setting}",
                "--plan",
                json.dumps(plan),
            ]
            command += ["--max-len", str(args.max_len), "--max-step-s", str(args.max_step_s)]
            command += ["--device", args.device, "--out", str(args.out)]
            try:
                subprocess.run(command, check=False, timeout=remaining, env=child_env(gpus))
            except subprocess.TimeoutExpired:
                print(f"   stopped at the time budget; {shape}:{setting} goes on in the next run", flush=True)
                stopped = True
            fruitless = fruitless + 1 if len(load_rows(args.out)) == len(rows) else 0
        if stopped:
            break
    rows = load_rows(args.out)
    print_table(rows)
    left = sum(len(plan_of(rows, *group, trainers, args.max_len, args.max_step_s)) for group in groups)
    combos = len(groups) * len(trainers)
    print("all done" if not left else f"{left} of {combos} left: run the same command again")


if __name__ == "__main__":
    main()
