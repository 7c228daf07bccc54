"""tandem's `rl` against TRL's GRPOTrainer: same start, task, reward, held-out set, group size, wall time.

    uv run python benchmarks/vs_trl.py                      # 10 minutes each, on this machine
    uv run python benchmarks/vs_trl.py --minutes 2          # a quick end-to-end check
    uv run python benchmarks/vs_trl.py --only tandem --tandem-arg=--trainer.optim.lr --tandem-arg=5e-5

Steps, one after the other, everything under `--out` (default runs/vs_trl):
1. start checkpoint (`sft/final`, built once): a 4.85M-parameter Qwen3 (6 layers, hidden 256) with
   its own tokenizer — a 512-token byte-level BPE trained here with the `tokenizers` library on
   English prose, GPT-2-style pre-tokenization (letter strings split into English-like pieces,
   "th", "er"..., unlike tandem's letter-by-letter tokenizer) and a ChatML chat template —
   under-trained by tandem's `sft` on reverse text (4–8 letters, `--sft-steps` 150: held-out 0.57).
2. TRL (`trl-*/`): GRPOTrainer in its own virtual environment (`trl-venv/`, made here with
   `python3 -m venv` and `pip install trl==1.16.0 <--trl-torch> transformers` unless `--trl-python`
   names one), driven by benchmarks/vs_trl_grpo.py: HF generate, tandem's reward function
   (tandem.envs.reverse_text.reward), `--batch-size` completions per step in groups of
   `--group-size`, lr `--trl-lr`, TRL's other defaults except gradient checkpointing (off).
3. tandem (`tandem-*/`): `rl @ examples/reverse_text/rl.toml --model.name <start>` with the same
   batch, group size and evaluation, plus `--tandem-arg`s; stopped with SIGINT when its time is up.

Fairness: each side's clock starts when its process starts (imports, model load and, for tandem,
server start-up count); both evaluate greedily the first `--eval-tasks` held-out tasks with at most
32 new tokens every `--eval-steps` steps. TRL's evaluation time is *not* counted against its wall
time (its clock pauses); tandem's is (it runs inside the orchestrator). Gain = the last held-out
reward within the wall time − the reward at step 0, by each side's own evaluator (both print the
start checkpoint's reward, so the two evaluators can be compared). `--only SIDE` reruns one side
and reuses the other's last result. Threads: whatever the environment says (OMP_NUM_THREADS);
tandem's launcher splits the cores between its processes itself.
"""

import argparse
import difflib
import json
import os
import random
import signal
import string
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tandem.models.loading import save_model
from tandem.models.tiny import TinyShape, tiny_qwen3_config

REPO = Path(__file__).resolve().parent.parent
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT_EXAMPLE = "Reverse the following text: "


def english_corpus() -> list[str]:
    """English prose for the tokenizer: the docstrings of a few standard-library modules."""
    modules = (argparse, difflib, json, random, string, textwrap)
    return [m.__doc__ or "" for m in modules] + [PROMPT_EXAMPLE] * 50


EVAL_MAX_TOKENS = 32


def train_foreign_tokenizer() -> PreTrainedTokenizerFast:
    """A 512-token byte-level BPE unlike tandem's: standard GPT-2 pre-tokenization with merges
    learned from English prose, so letter strings split into English-like pieces ("th", "er"...),
    not letter by letter."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(english_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.chat_template = CHATML
    return wrapped


def build_start(out: Path, sft_steps: int) -> Path:
    """Random-init model + foreign tokenizer, then tandem's `sft` on 4–8-letter texts; returns final/."""
    final = out / "sft" / "final"
    if (final / "config.json").exists():
        print(f"start checkpoint: {final} (exists; delete {out / 'sft'} to rebuild)")
        return final
    init = out / "init"
    tokenizer = train_foreign_tokenizer()
    torch.manual_seed(0)
    config = tiny_qwen3_config(TinyShape(), len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    save_model(model, tokenizer, init)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"built {params / 1e6:.2f}M-parameter Qwen3 ({config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}), tokenizer of {len(tokenizer)} tokens: {init}"
    )
    sft_toml = out / "sft.toml"
    sft_toml.write_text(
        f"""seq_len = 256
max_steps = {sft_steps}
run_dir = "{out / "sft"}"
seed = 0

[model]
name = "{init}"
device = "cpu"

[data]
task = "reverse_text"
num_examples = 20000
min_len = 4
max_len = 8
batch_size = 32
micro_batch_size = 8

[optim]
lr = 2e-3
weight_decay = 0.01
warmup_steps = 20
schedule = "constant"
max_grad_norm = 1.0

[eval]
interval = 50
final = true
num_tasks = 256
max_new_tokens = {EVAL_MAX_TOKENS}

[log]
interval = 25
"""
    )
    subprocess.run([str(Path(sys.executable).parent / "sft"), "@", str(sft_toml)], cwd=REPO, check=True)
    return final


def trl_python(out: Path, given: str | None, torch_spec: str) -> str:
    """TRL's interpreter: `given`, or a venv under `out` made here on first use."""
    if given:
        return given
    venv = out / "trl-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        print(
            f"installing TRL into {venv} (python3 -m venv; pip install trl==1.16.0 {torch_spec} transformers)"
        )
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "trl==1.16.0", torch_spec, "transformers"], check=True
        )
    return str(python)


def run_trl(python: str, start: Path, out: Path, seconds: float, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        python,
        str(REPO / "benchmarks" / "vs_trl_grpo.py"),
        "--model",
        str(start),
        "--out",
        str(out),
        "--seconds",
        str(seconds),
        "--lr",
        str(args.trl_lr),
        "--group-size",
        str(args.group_size),
        "--batch-size",
        str(args.batch_size),
        "--eval-steps",
        str(args.eval_steps),
        "--eval-tasks",
        str(args.eval_tasks),
        "--max-tokens",
        str(EVAL_MAX_TOKENS),
    ]
    with open(out / "trl.log", "w") as log:
        subprocess.run(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=seconds * 3 + 600
        )
    return json.loads((out / "result.json").read_text())


def run_tandem(start: Path, out: Path, seconds: float, args: argparse.Namespace) -> dict:
    """`rl` from `start` until `seconds` have passed since its launch, then SIGINT (a clean stop)."""
    command = [
        str(Path(sys.executable).parent / "rl"),
        "@",
        str(REPO / "examples/reverse_text/rl.toml"),
        "--model.name",
        str(start),
        "--run_dir",
        str(out),
        "--max_steps",
        "100000",
        "--orchestrator.group_size",
        str(args.group_size),
        "--orchestrator.batch_size",
        str(args.batch_size),
        "--orchestrator.eval.interval",
        str(args.eval_steps),
        "--orchestrator.eval.num_tasks",
        str(args.eval_tasks),
        "--orchestrator.eval.max_tokens",
        str(EVAL_MAX_TOKENS),
        *args.tandem_arg,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(out.parent / "tandem.log", "w") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while proc.poll() is None and time.time() - started < seconds:
            time.sleep(1)
        if proc.poll() is not None:
            raise SystemExit(f"tandem's rl exited early ({proc.returncode}); see {out.parent / 'tandem.log'}")
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = started + seconds
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r["time"] <= deadline]
    curve = [
        (r["step"], round(r["time"] - started, 1), round(r["eval/reward_mean"], 4))
        for r in records
        if "eval/reward_mean" in r
    ]
    steps = [r["time"] for r in records if r["source"] == "trainer"]
    gaps = sorted(b - a for a, b in zip(steps, steps[1:], strict=False))
    return {
        "curve": curve,
        "steps": len(steps),
        "s_per_step": gaps[len(gaps) // 2] if gaps else float("nan"),
        "seconds": seconds,
    }


def report(results: dict[str, dict]) -> None:
    print("\n| run | steps | s/step | held-out start | held-out end | gain |")
    print("|---|---|---|---|---|---|")
    gains = {}
    for name, r in results.items():
        curve = r["curve"]
        gains[name] = curve[-1][2] - curve[0][2]
        print(
            f"| {name} | {r['steps']} | {r['s_per_step']:.2f} | {curve[0][2]:.4f} | {curve[-1][2]:.4f} | "
            f"{gains[name]:+.4f} |"
        )
    print("\nheld-out curves (step, seconds, reward)")
    for name, r in results.items():
        print(f"{name}: " + "  ".join(f"{s}:{t:.0f}s:{v:.3f}" for s, t, v in r["curve"]))
    if gains.get("trl"):
        print(f"\ngain ratio tandem / trl: {gains['tandem'] / gains['trl']:.2f}")
    tr, ta = results["trl"]["s_per_step"], results["tandem"]["s_per_step"]
    print(f"per-step speed tandem vs trl: {tr / ta:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "vs_trl")
    p.add_argument("--minutes", type=float, default=10.0, help="Wall time of each side.")
    p.add_argument("--sft-steps", type=int, default=150, help="SFT steps of the start checkpoint.")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128, help="Completions per step (both sides).")
    p.add_argument("--eval-steps", type=int, default=25, help="Held-out evaluation every this many steps.")
    p.add_argument("--eval-tasks", type=int, default=256, help="First N held-out tasks.")
    p.add_argument("--trl-lr", type=float, default=5e-5)
    p.add_argument("--trl-python", help="Python of an environment with trl (default: make one under --out).")
    p.add_argument(
        "--trl-torch",
        default="torch",
        help="pip requirement for TRL's torch (e.g. 'torch==2.13.0+cpu' from a local wheel).",
    )
    p.add_argument("--tandem-arg", action="append", default=[], help="Extra `rl` override (repeatable).")
    p.add_argument(
        "--only", choices=["trl", "tandem"], help="Run one side (the other's last result is reused)."
    )
    args = p.parse_args()
    out = args.out.resolve()
    start = build_start(out, args.sft_steps).resolve()
    seconds = args.minutes * 60
    results = {}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for side in ("trl", "tandem"):
        saved = out / f"{side}-result.json"
        if args.only and args.only != side and saved.exists():
            results[side] = json.loads(saved.read_text())
            continue
        print(f"running {side} for {args.minutes:g} minutes ...", flush=True)
        if side == "trl":
            results[side] = run_trl(
                trl_python(out, args.trl_python, args.trl_torch), start, out / f"trl-{stamp}", seconds, args
            )
        else:
            results[side] = run_tandem(start, out / f"tandem-{stamp}" / "run", seconds, args)
        saved.write_text(json.dumps(results[side]))
    report(results)


if __name__ == "__main__":
    main()
