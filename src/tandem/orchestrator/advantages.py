"""Group-relative advantages: each completion's reward minus its prompt group's mean reward."""

import math

ZERO = 1e-9
STD_EPS = 1e-6


def group_advantages(rewards: list[float], std_normalize: bool = False) -> list[float]:
    """reward − mean(group); with `std_normalize`, divided by (population std + 1e-6)."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)  # exactly zero: a mean's rounding error must not fake a signal
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not std_normalize:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + STD_EPS) for c in centred]


def is_zero_advantage(advantages: list[float]) -> bool:
    """True when no completion of the group is better or worse than another: no learning signal."""
    return all(abs(a) < ZERO for a in advantages)
