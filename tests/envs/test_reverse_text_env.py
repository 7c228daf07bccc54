"""The reverse_text environment and the registry, without a server: splits, prompt, rewards."""

import pytest

from tandem.config.loader import ConfigError
from tandem.envs.base import Environment
from tandem.envs.registry import load_environment
from tandem.envs.reverse_text import PROMPT_PREFIX
from tandem.envs.reverse_text_env import ReverseTextEnv


def test_splits_are_fixed_disjoint_and_sized_by_args() -> None:
    env = load_environment(
        "reverse_text", {"num_train_tasks": 300, "num_eval_tasks": 30, "min_len": 5, "max_len": 7}
    )
    train, held_out = env.dataset("train"), env.dataset("eval")
    assert len(train) == 300 and len(held_out) == 30
    assert {t.text for t in train}.isdisjoint({t.text for t in held_out})
    assert all(5 <= len(t.text) <= 7 for t in train)
    assert [t.task_id for t in train] == [t.task_id for t in ReverseTextEnv(env.args).dataset("train")]
    assert len({t.task_id for t in train}) == 300


def test_prompt_is_the_shared_format_and_rewards_score_the_last_answer() -> None:
    env = ReverseTextEnv()
    task = env.dataset("eval")[0]
    assert env.prompt(task) == [{"role": "user", "content": PROMPT_PREFIX + task.text}]
    exact = [{"role": "assistant", "content": f" {task.text[::-1]}\n"}]
    assert env.score(task, exact) == (1.0, {"similarity": 1.0, "exact_match": 1.0})
    half = task.text[::-1][: len(task.text) // 2]
    reward, metrics = env.score(task, [{"role": "assistant", "content": half}])
    # SequenceMatcher ratio: 2 * matches / (len(a) + len(b))
    assert reward == pytest.approx(2 * len(half) / (len(half) + len(task.text)))
    assert metrics["exact_match"] == 0.0 and metrics["similarity"] == reward
    assert env.score(task, []) == (0.0, {"similarity": 0.0, "exact_match": 0.0})


def test_registry_loads_by_import_path_and_rejects_bad_args() -> None:
    env = load_environment("tandem.envs.reverse_text_env:ReverseTextEnv", {"num_eval_tasks": 3})
    assert isinstance(env, Environment) and len(env.dataset("eval")) == 3
    with pytest.raises(ConfigError, match="not a tandem Environment"):
        load_environment("tandem.envs.reverse_text:ReverseTextTask")
    with pytest.raises(ConfigError, match="cannot import 'no.such.module:Env'"):
        load_environment("no.such.module:Env")
    with pytest.raises(ConfigError, match="min_len <= max_len"):
        load_environment("reverse_text", {"min_len": 9, "max_len": 5})
