"""`uv run eval`: greedy-decode held-out tasks with transformers and score them.

    uv run eval --model.name runs/reverse-sft/final --num-tasks 200

Prints the mean reward and the exact-match rate, and writes them (with every completion) to
`out` when given. Decoding uses plain transformers `generate`, batched with left padding; it is
a reference evaluator independent of tandem's inference engine.
"""

import json
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from tandem.cli import UserError, run_cli
from tandem.config import ModelConfig, Section, parse_config
from tandem.envs import reverse_text
from tandem.models.loading import load_model, load_tokenizer


class EvalConfig(Section):
    model: ModelConfig = ModelConfig()
    env: Literal["reverse_text"] = Field("reverse_text", description="Environment to evaluate on.")
    num_tasks: int = Field(200, gt=0, description="Held-out tasks to decode.")
    batch_size: int = Field(64, gt=0, description="Prompts decoded together.")
    max_new_tokens: int = Field(32, gt=0, description="Longest completion decoded per task.")
    seed: int = Field(0, description="Seed of the held-out task generator.")
    out: Path | None = Field(None, description="Write results as JSON here.")


@torch.inference_mode()
def greedy_completions(
    model, tokenizer, prompts: list[list[dict]], batch_size: int, max_new: int
) -> list[str]:
    tokenizer.padding_side = "left"
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chats = prompts[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        out = model.generate(
            **batch,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = out[:, batch["input_ids"].shape[1] :]
        completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    return completions


def evaluate(cfg: EvalConfig) -> dict:
    tokenizer = load_tokenizer(cfg.model.name)
    model = load_model(cfg.model).eval()
    tasks = reverse_text.make_tasks("eval", cfg.num_tasks, seed=cfg.seed)
    start = time.perf_counter()
    completions = greedy_completions(
        model, tokenizer, [t.messages for t in tasks], cfg.batch_size, cfg.max_new_tokens
    )
    rewards = [reverse_text.reward(c, t) for c, t in zip(completions, tasks, strict=True)]
    exact = [c.strip() == t.answer for c, t in zip(completions, tasks, strict=True)]
    result = {
        "model": cfg.model.name,
        "env": cfg.env,
        "num_tasks": len(tasks),
        "mean_reward": sum(rewards) / len(rewards),
        "exact_match": sum(exact) / len(exact),
        "seconds": time.perf_counter() - start,
        "samples": [
            {"task_id": t.task_id, "text": t.text, "completion": c, "reward": r}
            for t, c, r in zip(tasks, completions, rewards, strict=True)
        ],
    }
    if cfg.out:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    def run() -> None:
        cfg = parse_config(EvalConfig, prog="eval")
        if not cfg.model.name:
            raise UserError("model.name is required, e.g. --model.name runs/reverse-sft/final")
        result = evaluate(cfg)
        print(
            f"{result['env']}: {result['num_tasks']} held-out tasks, mean reward {result['mean_reward']:.4f}, "
            f"exact match {result['exact_match']:.4f} ({result['seconds']:.1f}s)"
        )

    run_cli(run, "eval")


if __name__ == "__main__":
    main()
