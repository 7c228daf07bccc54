"""Held-out evaluation during SFT: greedy answers to the task's eval split, scored by its reward.

Every rank decodes the same prompts (the model is sharded, so all ranks must run the same
forward passes); rank 0 logs the result.
"""

import time

from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.envs import reverse_text
from tandem.models.generate import greedy_completions
from tandem.trainer.sft.config import EvalConfig


def evaluate_held_out(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: EvalConfig, seed: int
) -> dict[str, float]:
    """`eval/reward` (mean similarity) and `eval/exact_match` on the first num_tasks held-out tasks."""
    tasks = reverse_text.make_tasks("eval", cfg.num_tasks, seed=seed)
    start = time.monotonic()
    was_training = model.training
    model.eval()
    try:
        answers = greedy_completions(
            model, tokenizer, [t.messages for t in tasks], cfg.batch_size, cfg.max_new_tokens
        )
    finally:
        model.train(was_training)
    rewards = [reverse_text.reward(a, t) for a, t in zip(answers, tasks, strict=True)]
    exact = [a.strip() == t.answer for a, t in zip(answers, tasks, strict=True)]
    return {
        "eval/reward": sum(rewards) / len(rewards),
        "eval/exact_match": sum(exact) / len(exact),
        "eval/seconds": time.monotonic() - start,
    }
