"""The collapse warning: reward and sampling entropy falling together at N evaluations in a row."""

from tandem.envs.base import Trajectory
from tandem.orchestrator.collapse import CollapseWatch


def rollout(logprob: float, env_tokens: int = 0) -> Trajectory:
    """Four sampled tokens of `logprob` each, then `env_tokens` environment tokens (logprob 0)."""
    return Trajectory(
        task_id="t",
        prompt_ids=[1, 2],
        completion_ids=[3] * (4 + env_tokens),
        completion_mask=[1] * 4 + [0] * env_tokens,
        completion_logprobs=[logprob] * 4 + [0.0] * env_tokens,
        weight_versions=[0],
        reward=0.0,
    )


def feed(watch: CollapseWatch, evals: list[tuple[float, float]]) -> list[str | None]:
    """An evaluation before the first step, then per (reward, entropy) one step of rollouts and an evaluation."""
    warnings = [watch.evaluated(0, 0.9)]
    for i, (reward, entropy) in enumerate(evals, start=1):
        watch.add([rollout(-entropy, env_tokens=3), rollout(-entropy)])
        warnings.append(watch.evaluated(25 * i, reward))
    return warnings


def test_warns_only_after_n_joint_falls_and_reads_model_tokens_only() -> None:
    watch = CollapseWatch(evaluations=3)
    warnings = feed(watch, [(0.6, 1.0), (0.58, 0.8), (0.55, 0.5), (0.50, 0.2)])
    assert warnings[:4] == [None, None, None, None]
    assert warnings[4] is not None
    assert "3 evaluations in a row" in warnings[4] and "0.600 → 0.580 → 0.550 → 0.500" in warnings[4]
    assert "1.000 → 0.800 → 0.500 → 0.200" in warnings[4]  # environment tokens left out of the mean
    assert [h[0] for h in watch.history] == [25, 50, 75, 100]


def test_no_warning_when_entropy_holds_or_reward_recovers_or_disabled() -> None:
    assert feed(CollapseWatch(3), [(0.6, 1.0), (0.58, 1.1), (0.55, 0.5), (0.5, 0.2)])[-1] is None
    assert feed(CollapseWatch(3), [(0.6, 1.0), (0.58, 0.8), (0.59, 0.5), (0.5, 0.2)])[-1] is None
    assert all(w is None for w in feed(CollapseWatch(0), [(0.6, 1.0), (0.5, 0.5), (0.4, 0.2), (0.3, 0.1)]))
