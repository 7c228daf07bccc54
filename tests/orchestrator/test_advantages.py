"""Group-relative advantages and the task order, checked against hand-computed values."""

import itertools
import math

import pytest

from tandem.orchestrator.advantages import group_advantages, is_zero_advantage
from tandem.orchestrator.tasks import step_task_order


def test_advantage_is_reward_minus_group_mean() -> None:
    # mean of [1, 0, 0.5, 0.5] is 0.5
    assert group_advantages([1.0, 0.0, 0.5, 0.5]) == [0.5, -0.5, 0.0, 0.0]
    # mean of [0.2, 0.4, 0.9] is 0.5
    assert group_advantages([0.2, 0.4, 0.9]) == pytest.approx([-0.3, -0.1, 0.4])


def test_std_normalisation_divides_by_population_std() -> None:
    # rewards [1, 0, 0.5, 0.5]: centred [0.5, -0.5, 0, 0], population std sqrt(0.5 / 4) = 0.353553...
    std = math.sqrt(0.125)
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0]
    assert group_advantages([1.0, 0.0, 0.5, 0.5], std_normalize=True) == pytest.approx(expected)
    assert group_advantages([3.0, 1.0], std_normalize=True) == pytest.approx([1.0, -1.0], abs=1e-5)


def test_equal_rewards_give_zero_advantages_even_with_std_normalisation() -> None:
    for normalise in (False, True):
        advantages = group_advantages([0.7, 0.7, 0.7], std_normalize=normalise)
        assert advantages == [0.0, 0.0, 0.0]
        assert is_zero_advantage(advantages)
    assert not is_zero_advantage(group_advantages([0.7, 0.7, 0.71]))
    with pytest.raises(ValueError):
        group_advantages([])


def test_task_order_depends_on_seed_and_step_only() -> None:
    first = list(itertools.islice(step_task_order(10, seed=3, step=5), 25))
    assert first == list(itertools.islice(step_task_order(10, seed=3, step=5), 25))
    assert sorted(first[:10]) == list(range(10)), "each pass is a permutation of the dataset"
    assert sorted(first[10:20]) == list(range(10))
    assert first[:10] != list(itertools.islice(step_task_order(10, seed=3, step=6), 10))
    assert first[:10] != list(itertools.islice(step_task_order(10, seed=4, step=5), 10))
