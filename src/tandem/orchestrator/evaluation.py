"""Evaluation on the environments' held-out splits, through the inference servers, with whatever
policy they serve now: the orchestrator's periodic greedy evaluation and the `evaluate` command.

Each of the first `num_tasks` held-out tasks of every environment is played `n` times by the same
rollout code as training (`play_group`: timeout and trajectory checks included). A task whose
rollouts fail is logged with its environment, id and reason, counted as failed, and the rest
goes on. With n > 1 and a binary success metric, pass@k is the unbiased estimator
1 − C(n−c, k) / C(n, k) per task (c successes of n; a failed task has c = 0), averaged over tasks.
"""

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.client.config import SamplingConfig
from tandem.client.inference import ServerPool, ServerUnavailable
from tandem.envs.base import Environment, Trajectory
from tandem.envs.mixture import Member
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.rollouts import play_group
from tandem.orchestrator.stats import per_env_stats, trajectory_stats

log = logging.getLogger(__name__)

SUCCESS_METRICS = ("exact_match", "correct", "win", "solved", "passed", "success")
"""Metric names read as binary success when an environment declares no `success_metric`."""


@dataclass
class TaskResult:
    env: str
    task_id: str
    trajectories: list[Trajectory]
    error: str | None = None


async def run_eval(
    members: Sequence[Member],
    pool: ServerPool,
    num_tasks: int,
    sampling: SamplingConfig,
    n: int,
    timeout: float,
    seq_len: int,
) -> list[TaskResult]:
    """Every environment's first `num_tasks` held-out tasks, `n` rollouts each, all at once."""

    async def one(member: Member, task: Any) -> TaskResult:
        async with pool.lease() as client:
            try:
                trajectories = await play_group(member.env, task, client, sampling, n, timeout, seq_len)
            except ServerUnavailable as down:  # the run stops, naming the rollout it stopped at
                raise ServerUnavailable(
                    f"eval rollout of env {member.name} task {task.task_id}: {down}"
                ) from None
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                log.error("eval rollout of env %s task %s failed: %s", member.name, task.task_id, reason)
                return TaskResult(member.name, task.task_id, [], reason)
        return TaskResult(member.name, task.task_id, trajectories)

    jobs = [one(m, task) for m in members for task in list(m.env.dataset("eval"))[:num_tasks]]
    return list(await asyncio.gather(*jobs))


def success_metric(env: Environment, trajectories: Sequence[Trajectory]) -> str | None:
    """The environment's binary success metric: its declared `success_metric`, else the first of
    SUCCESS_METRICS it reports; None unless every reported value is 0 or 1."""
    declared = getattr(env, "success_metric", None)
    for name in [declared] if declared else SUCCESS_METRICS:
        values = [t.metrics[name] for t in trajectories if name in t.metrics]
        if values:
            return name if all(v in (0.0, 1.0) for v in values) else None
    return None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) is correct."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n."""
    return sorted({*(2**i for i in range(n.bit_length()) if 2**i < n), n})


def pass_stats(results: Sequence[TaskResult], metric: str, n: int) -> dict[int, float]:
    """pass@k for every k in k_values(n), averaged over tasks."""
    counts = [sum(t.metrics.get(metric) == 1.0 for t in r.trajectories) for r in results]
    return {k: sum(pass_at_k(n, c, k) for c in counts) / len(counts) for k in k_values(n)}


def eval_stats(
    members: Sequence[Member], results: Sequence[TaskResult], n: int, prefix: str = "eval/"
) -> dict[str, float]:
    """Over all environments (`eval/reward_mean`, `eval/env/<metric>`, ...) and per environment
    (`eval/env/<name>/...`: stats, metrics, num_tasks, failed, and pass@k when n > 1)."""
    stats = trajectory_stats([t for r in results for t in r.trajectories], prefix)
    stats[f"{prefix}num_tasks"] = float(len(results))
    stats[f"{prefix}failed"] = float(sum(r.error is not None for r in results))
    by_env = {m.name: [r for r in results if r.env == m.name] for m in members}
    stats.update(
        per_env_stats({name: [t for r in rs for t in r.trajectories] for name, rs in by_env.items()}, prefix)
    )
    for member in members:
        env_results = by_env[member.name]
        key = f"{prefix}env/{member.name}/"
        stats[key + "num_tasks"] = float(len(env_results))
        stats[key + "failed"] = float(sum(r.error is not None for r in env_results))
        metric = success_metric(member.env, [t for r in env_results for t in r.trajectories])
        if n > 1 and metric and env_results:
            for k, value in pass_stats(env_results, metric, n).items():
                stats[f"{key}pass@{k}"] = value
    return stats


async def evaluate(members: Sequence[Member], pool: ServerPool, cfg: OrchestratorConfig) -> dict[str, float]:
    """The orchestrator's periodic evaluation: greedy, one rollout per held-out task."""
    greedy = SamplingConfig(
        temperature=0.0, top_p=1.0, max_tokens=cfg.eval.max_tokens or cfg.sampling.max_tokens
    )
    start = time.perf_counter()
    results = await run_eval(members, pool, cfg.eval.num_tasks, greedy, 1, cfg.rollout_timeout, cfg.seq_len)
    stats = eval_stats(members, results, n=1)
    stats["eval/seconds"] = time.perf_counter() - start
    return stats
