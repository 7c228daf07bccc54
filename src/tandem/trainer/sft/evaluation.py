"""Held-out evaluation during SFT: greedy answers to the task's eval split, scored by its reward.

The sharded model is exported (trainer/hf_export.py, a collective; LoRA merged) to `run_dir/.eval_model`,
and rank 0 decodes it there with plain transformers — a reference decoder independent of
tandem's training code and its engine. The other ranks wait and receive the result.
"""

import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.config.base import ModelConfig
from tandem.envs import reverse_text
from tandem.models.generate import greedy_completions
from tandem.models.loading import load_model
from tandem.trainer.hf_export import write_hf_model
from tandem.trainer.parallel import World
from tandem.trainer.sft.config import EvalConfig


def evaluate_held_out(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EvalConfig,
    seed: int,
    run_dir: Path,
    world: World,
) -> dict[str, float]:
    """`eval/reward` (mean similarity) and `eval/exact_match` on the first num_tasks held-out tasks
    (the weights exported as write_hf_model does with this `optimizer`)."""
    start = time.monotonic()
    export = Path(run_dir) / ".eval_model"
    write_hf_model(model, tokenizer, export, world, merged=True, optimizer=optimizer)
    result: list[dict[str, float] | None] = [None]
    if world.is_main:
        reference = load_model(ModelConfig(name=str(export), dtype="float32"), world.device)
        tasks = reverse_text.make_tasks("eval", cfg.num_tasks, seed=seed)
        answers = greedy_completions(
            reference.eval(), tokenizer, [t.messages for t in tasks], cfg.batch_size, cfg.max_new_tokens
        )
        shutil.rmtree(export, ignore_errors=True)
        rewards = [reverse_text.reward(a, t) for a, t in zip(answers, tasks, strict=True)]
        exact = [a.strip() == t.answer for a, t in zip(answers, tasks, strict=True)]
        result[0] = {
            "eval/reward": sum(rewards) / len(rewards),
            "eval/exact_match": sum(exact) / len(exact),
            "eval/seconds": time.monotonic() - start,
        }
    if world.size > 1:
        dist.broadcast_object_list(result, src=0)
    return result[0]
