"""Alphabet sort: tasks, the environment's turns, rewards on hand-made transcripts, a real server."""

import asyncio
from pathlib import Path

import pytest

from tandem.client.config import ClientConfig, SamplingConfig
from tandem.client.inference import InferenceClient
from tandem.config.loader import ConfigError
from tandem.envs.alphabet_sort import AlphabetSortEnv, SortTask, exact_turns, solved, sorted_score
from tandem.envs.base import Message
from tandem.envs.registry import load_environment
from tandem.models.loading import load_tokenizer

TASK = SortTask("t", (("Maya", "Ben"), ("Ada",), ("Zoe", "Carl")))


def play(*answers: str) -> list[Message]:
    env = AlphabetSortEnv()
    messages: list[Message] = []
    for text in answers:
        messages.append({"role": "assistant", "content": text})
        messages += asyncio.run(env.env_response(TASK, messages)) or []
    return messages


def test_environment_reveals_names_turn_by_turn() -> None:
    env = AlphabetSortEnv()
    assert "Maya, Ben" in env.prompt(TASK)[0]["content"]
    messages = play("Ben, Maya", "Ada, Ben, Maya", "Ada, Ben, Carl, Maya, Zoe")
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "More names: Ada. Sort all names so far.",
        "More names: Zoe, Carl. Sort all names so far.",
    ]
    assert messages[-1]["role"] == "assistant"  # no reply after the last turn
    assert env.score(TASK, messages) == (1.0, {"sorted": 1.0, "exact_turns": 1.0, "solved": 1.0})


def test_partial_and_missing_turns() -> None:
    # turn 1 right; turn 2 misses a name (2 of 3 match: ratio 2*2/(2+3) = 0.8); turn 3 never answered
    messages = play("Ben, Maya.", "Ben, Maya")
    assert sorted_score(TASK, messages) == pytest.approx((1.0 + 0.8 + 0.0) / 3)
    assert exact_turns(TASK, messages) == pytest.approx(1 / 3)
    assert solved(TASK, messages) == 0.0
    wrong_order = play("Maya, Ben")
    assert sorted_score(TASK, wrong_order) == pytest.approx(0.5 / 3)  # one of two names in order


def test_malformed_answers() -> None:
    for text in ["", "   ", ",,,", "ben, maya", "Ben Maya", "<|im_start|>"]:
        messages: list[Message] = [{"role": "assistant", "content": text}]
        assert exact_turns(TASK, messages) == 0.0 and sorted_score(TASK, messages) < 1 / 3
    assert sorted_score(TASK, []) == 0.0


def test_tasks_and_splits() -> None:
    env = AlphabetSortEnv(
        AlphabetSortEnv.Args(num_train_tasks=300, num_eval_tasks=50, min_turns=2, max_turns=3)
    )
    train, held_out = env.dataset("train"), env.dataset("eval")
    assert len(train) == 300 and len(held_out) == 50
    assert not {t.batches for t in train} & {t.batches for t in held_out}
    for t in train:
        names = [n for b in t.batches for n in b]
        assert 2 <= len(t.batches) <= 3 and all(1 <= len(b) <= 3 for b in t.batches)
        assert len(set(names)) == len(names)
    assert [t.batches for t in AlphabetSortEnv(env.args).dataset("eval")] == [t.batches for t in held_out]
    with pytest.raises(ConfigError, match="min_turns"):
        load_environment("alphabet_sort", {"min_turns": 5, "max_turns": 3})


def test_real_rollouts_have_one_model_turn_per_task_turn(server: str, model: Path) -> None:
    env = load_environment("alphabet_sort", {"num_train_tasks": 4, "num_eval_tasks": 1})
    env.setup(load_tokenizer(str(model)), 512)
    tasks = env.dataset("train")

    async def run() -> list:
        client = InferenceClient(server, ClientConfig(request_timeout=60))
        try:
            await client.connect()
            groups = [env.rollout_group(t, client, SamplingConfig(max_tokens=10), 2) for t in tasks]
            return [t for group in await asyncio.gather(*groups) for t in group]
        finally:
            await client.close()

    trajectories = asyncio.run(run())
    assert len(trajectories) == 8
    for t in trajectories:
        task = next(task for task in tasks if task.task_id == t.task_id)
        assert len(t.turns) == len(task.batches) == t.metrics["turns"]
        replies = [m["content"] for m in t.messages if m["role"] == "user"]
        assert replies == [f"More names: {', '.join(b)}. Sort all names so far." for b in task.batches[1:]]
        assert t.reward == t.metrics["sorted"] and 0.0 <= t.reward < 1.0
