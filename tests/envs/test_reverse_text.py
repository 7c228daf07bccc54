"""The reverse-text task: format, splits, determinism and reward."""

import string

import pytest

from tandem.envs.reverse_text import PROMPT_PREFIX, ReverseTextTask, make_tasks, reward


def test_prompt_format_and_lengths() -> None:
    tasks = make_tasks("train", 500, seed=3)
    lengths = {len(t.text) for t in tasks}
    assert lengths == set(range(4, 17))
    for t in tasks:
        assert set(t.text) <= set(string.ascii_lowercase)
        assert t.messages == [{"role": "user", "content": f"Reverse the following text: {t.text}"}]
        assert t.answer == t.text[::-1]
    assert PROMPT_PREFIX == "Reverse the following text: "


def test_seeded_and_splits_disjoint() -> None:
    assert make_tasks("train", 50, seed=1) == make_tasks("train", 50, seed=1)
    assert make_tasks("train", 50, seed=1) != make_tasks("train", 50, seed=2)
    train = {t.text for t in make_tasks("train", 3000)}
    held_out = {t.text for t in make_tasks("eval", 300)}
    assert not train & held_out


def test_reward() -> None:
    task = ReverseTextTask("t", "abcdef")
    assert reward("fedcba", task) == 1.0
    assert reward(" fedcba\n", task) == 1.0
    assert reward("", task) == 0.0
    assert reward("xyz", task) == 0.0
    assert reward("fedcb", task) == pytest.approx(2 * 5 / 11)
    assert 0 < reward("fedxba", task) < 1
