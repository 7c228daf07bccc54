"""Whether every prompt plus its generation limit fits in `seq_len`, checked before any rollout.

The launcher checks before starting anything (without torch: the model directory's tokenizer.json
through `tokenizers`, its chat template through transformers' own renderer), and the orchestrator
checks again with the tokenizer it serves with. Only single-turn environments have fixed prompts.
"""

import json
from collections.abc import Callable
from pathlib import Path

from tandem.cli import UserError
from tandem.envs.base import Environment, Message, SingleTurnEnv
from tandem.orchestrator.config import OrchestratorConfig

PROMPT_CHECK_LIMIT = 5000
"""Training tasks measured per environment (all of the evaluation tasks that are used)."""

CANDIDATES = 32
"""With an estimate: how many of the prompts it ranks longest are rendered with the chat template."""
CountTokens = Callable[[list[Message]], int]
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def check_prompt_lengths(
    env: Environment, cfg: OrchestratorConfig, count: CountTokens, estimate: CountTokens | None = None
) -> None:
    """UserError when the longest prompt (with the chat template) plus its generation limit
    exceeds seq_len: training tasks with sampling.max_tokens, and (when evaluation is on) the
    held-out ones with eval.max_tokens.

    `estimate`: a cheaper measure of each prompt; then only the CANDIDATES prompts it ranks
    longest are counted with `count`."""
    if not isinstance(env, SingleTurnEnv):
        return
    splits = [
        (list(env.dataset("train"))[:PROMPT_CHECK_LIMIT], cfg.sampling.max_tokens, "sampling.max_tokens")
    ]
    if cfg.eval.interval:
        limit = cfg.eval.max_tokens or cfg.sampling.max_tokens
        key = "eval.max_tokens" if cfg.eval.max_tokens else "sampling.max_tokens"
        splits.append((list(env.dataset("eval"))[: cfg.eval.num_tasks], limit, key))
    for tasks, max_tokens, key in splits:
        if estimate is not None:
            tasks = sorted(tasks, key=lambda t: estimate(env.prompt(t)), reverse=True)[:CANDIDATES]
        longest, task_id = max(((count(env.prompt(t)), t.task_id) for t in tasks), default=(0, ""))
        if longest + max_tokens > cfg.seq_len:
            raise UserError(
                f"seq_len {cfg.seq_len} cannot fit one sample: prompt of task {task_id} has {longest} tokens "
                f"+ {key} {max_tokens}"
            )


def local_token_counters(model: str) -> tuple[CountTokens, CountTokens] | None:
    """(exact count, estimate) of prompt tokens for a local model directory, without torch: the
    estimate counts the messages' text alone (no transformers import, no template). None when the
    directory has no tokenizer.json or chat template (a hub name: the orchestrator checks)."""
    path = Path(model).expanduser()
    config_file, tokenizer_file, template_file = (
        path / n for n in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja")
    )
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    template = (
        template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    )
    if not isinstance(template, str):
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    specials = {k: v["content"] if isinstance(v, dict) else v for k in SPECIAL_TOKENS if (v := config.get(k))}

    def count(messages: list[Message]) -> int:
        from transformers.utils.chat_template_utils import render_jinja_template  # seconds: only if needed

        rendered, _ = render_jinja_template(
            conversations=[messages], chat_template=template, add_generation_prompt=True, **specials
        )
        return len(tokenizer.encode(rendered[0], add_special_tokens=False).ids)

    def estimate(messages: list[Message]) -> int:
        text = "".join(str(m.get("content") or "") for m in messages)
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count, estimate
