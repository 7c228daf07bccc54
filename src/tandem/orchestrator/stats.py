"""The numbers the orchestrator logs per step and per evaluation."""

import math
from collections.abc import Sequence

from tandem.envs.base import Trajectory


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def std(values: Sequence[float]) -> float:
    m = mean(values)
    return math.sqrt(mean([(v - m) ** 2 for v in values]))


def trajectory_stats(
    trajectories: Sequence[Trajectory], prefix: str = "", metric_prefix: str = "env/"
) -> dict[str, float]:
    """Reward, lengths, truncation and the mean of every environment metric (over the
    trajectories that report it), as `{prefix}{metric_prefix}<metric>`."""
    rewards = [t.reward for t in trajectories]
    completion = [sum(t.completion_mask) for t in trajectories]
    stats = {
        f"{prefix}reward_mean": mean(rewards),
        f"{prefix}reward_std": std(rewards),
        f"{prefix}completion_len_mean": mean(completion),
        f"{prefix}completion_len_max": float(max(completion, default=0)),
        f"{prefix}prompt_len_mean": mean([len(t.prompt_ids) for t in trajectories]),
        f"{prefix}truncated_frac": mean([float(t.truncated) for t in trajectories]),
    }
    names = sorted({k for t in trajectories for k in t.metrics})
    for name in names:
        stats[f"{prefix}{metric_prefix}{name}"] = mean(
            [t.metrics[name] for t in trajectories if name in t.metrics]
        )
    return stats


def per_env_stats(by_env: dict[str, Sequence[Trajectory]], prefix: str = "") -> dict[str, float]:
    """`trajectory_stats` of each environment as `{prefix}env/<name>/<stat or metric>`, plus its
    sample count."""
    stats: dict[str, float] = {}
    for name, trajectories in by_env.items():
        stats.update(trajectory_stats(trajectories, prefix=f"{prefix}env/{name}/", metric_prefix=""))
        stats[f"{prefix}env/{name}/num_samples"] = float(len(trajectories))
    return stats


def staleness_stats(trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
    """How many policy versions behind step N the samples' oldest tokens were."""
    staleness = [step - t.policy_version for t in trajectories]
    return {
        "staleness_mean": mean(staleness),
        "staleness_max": float(max(staleness, default=0)),
        "policy_version_min": float(min((t.policy_version for t in trajectories), default=0)),
        "policy_version_max": float(
            max((t.weight_versions[-1] for t in trajectories if t.weight_versions), default=0)
        ),
    }
