"""Greedy evaluation on the first `num_tasks` held-out tasks, with whatever the servers serve now."""

import asyncio
import logging
import time
from typing import Any

from tandem.envs.base import Environment, Trajectory
from tandem.orchestrator.client import ServerPool, ServerUnavailable
from tandem.orchestrator.config import OrchestratorConfig, SamplingConfig
from tandem.orchestrator.stats import trajectory_stats

log = logging.getLogger(__name__)


async def evaluate(env: Environment, pool: ServerPool, cfg: OrchestratorConfig) -> dict[str, float]:
    """Metrics prefixed `eval/`: reward and environment metrics (exact match where defined)."""
    tasks = list(env.dataset("eval"))[: cfg.eval.num_tasks]
    greedy = SamplingConfig(
        temperature=0.0, top_p=1.0, max_tokens=cfg.eval.max_tokens or cfg.sampling.max_tokens
    )

    async def one(task: Any) -> Trajectory | None:
        async with pool.lease() as client:
            try:
                return await env.rollout(task, client, greedy)
            except ServerUnavailable:
                raise
            except Exception as e:
                log.error("eval rollout of task %s failed: %s: %s", task.task_id, type(e).__name__, e)
                return None

    start = time.perf_counter()
    results = await asyncio.gather(*(one(t) for t in tasks))
    done = [t for t in results if t is not None]
    stats = trajectory_stats(done, prefix="eval/")
    stats["eval/num_tasks"] = float(len(tasks))
    stats["eval/failed"] = float(len(tasks) - len(done))
    stats["eval/seconds"] = time.perf_counter() - start
    return stats
