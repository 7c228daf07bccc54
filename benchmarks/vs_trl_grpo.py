"""TRL's side of benchmarks/vs_trl.py: GRPOTrainer on reverse text for a fixed wall time.

Runs in TRL's own virtual environment (no tandem dependencies: tandem's reward module is loaded
from its file, it imports only the standard library):

    trl-venv/bin/python benchmarks/vs_trl_grpo.py --model START --out DIR --seconds 600

The clock starts when this script starts; time spent in the held-out evaluation (greedy HF
generate of the first `--eval-tasks` held-out tasks, every `--eval-steps` steps as tandem's
orchestrator does, none extra at the stop) is not counted. Writes DIR/result.json: the held-out curve [(step, seconds, reward)], steps and
median seconds per step.
"""

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

STARTED = time.time()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

SPEC = importlib.util.spec_from_file_location(
    "reverse_text", Path(__file__).resolve().parent.parent / "src/tandem/envs/reverse_text.py"
)
reverse_text = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(reverse_text)


def reward_fn(completions: list, text: list[str], **_: object) -> list[float]:
    """tandem's reverse-text reward (difflib similarity to the reversed text) on each completion."""
    return [
        reverse_text.reward(c[-1]["content"], reverse_text.ReverseTextTask("", t))
        for c, t in zip(completions, text, strict=True)
    ]


@torch.no_grad()
def held_out_reward(model, tokenizer, tasks: list, max_tokens: int, batch: int = 128) -> float:
    """Greedy decoding of each task's chat, mean reward (as tandem's orchestrator evaluates)."""
    model.eval()
    rewards = []
    for i in range(0, len(tasks), batch):
        chunk = tasks[i : i + batch]
        prompts = [
            tokenizer.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=False)
            for t in chunk
        ]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        rewards += [reverse_text.reward(c, t) for c, t in zip(texts, chunk, strict=True)]
    model.train()
    return sum(rewards) / len(rewards)


class WallClock(TrainerCallback):
    """Held-out evaluation every `eval_steps` and a stop after `seconds` of non-evaluation time."""

    def __init__(self, tokenizer, tasks: list, seconds: float, eval_steps: int, max_tokens: int) -> None:
        self.tokenizer, self.tasks, self.seconds, self.eval_steps = tokenizer, tasks, seconds, eval_steps
        self.max_tokens = max_tokens
        self.eval_time = 0.0
        self.curve: list[tuple[int, float, float]] = []
        self.step_ends: list[float] = []

    def elapsed(self) -> float:
        return time.time() - STARTED - self.eval_time

    def evaluate(self, model, step: int) -> None:
        began = time.time()
        reward = held_out_reward(model, self.tokenizer, self.tasks, self.max_tokens)
        self.eval_time += time.time() - began
        self.curve.append((step, round(self.elapsed(), 1), round(reward, 4)))
        print(f"trl eval at step {step} ({self.elapsed():.0f} s): reward {reward:.4f}", flush=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.step_ends.append(self.elapsed())
        if self.elapsed() >= self.seconds:
            control.should_training_stop = True
        if state.global_step % self.eval_steps == 0 and not control.should_training_stop:
            self.evaluate(model, state.global_step)  # as tandem: every eval_steps, none at the stop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128, help="Completions per step.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--eval-steps", type=int, default=25)
    p.add_argument("--eval-tasks", type=int, default=256)
    args = p.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train = reverse_text.make_tasks("train", 20_000)
    held_out = reverse_text.make_tasks("eval", 500)[: args.eval_tasks]
    dataset = Dataset.from_list([{"prompt": t.messages, "text": t.text} for t in train])
    config = GRPOConfig(
        output_dir=str(args.out / "checkpoints"),
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        # TRL's default (True) also turns off the KV cache in generate: 201 s for the first step
        # here instead of seconds. A 4.9M model needs no activation checkpointing.
        gradient_checkpointing=False,
        # TRL's default bf16 autocast runs CPU matmuls through a slow bf16 fallback
        # (bf16_dot_with_fp32_arith): minutes per backward here. fp32, like tandem on CPU.
        bf16=False,
        max_steps=1_000_000,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    clock = WallClock(tokenizer, held_out, args.seconds, args.eval_steps, args.max_tokens)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    gaps = [b - a for a, b in zip(clock.step_ends, clock.step_ends[1:], strict=False)]
    result = {
        "curve": clock.curve,
        "steps": len(clock.step_ends),
        "s_per_step": statistics.median(gaps) if gaps else float("nan"),
        "seconds": round(clock.elapsed(), 1),
        "eval_seconds": round(clock.eval_time, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
