"""Collect one step's batch: groups of rollouts, scored, with group-relative advantages.

A step needs `batch_size / group_size` groups. All of them are requested at once, each from the
least-loaded server; a group whose rollout fails (the environment crashed, the server refused the
request) is logged with its task id and replaced by the next task, and so is a zero-advantage
group when filtering is on. The tasks of step N come from `step_task_order(seed, N)`.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.cli import UserError
from tandem.envs.base import Environment, Trajectory
from tandem.orchestrator.advantages import group_advantages, is_zero_advantage
from tandem.orchestrator.client import ServerPool, ServerUnavailable
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.tasks import step_task_order
from tandem.transport.rollouts import Sample

log = logging.getLogger(__name__)


class RolloutsFailing(UserError):
    """Too many rollouts of one step failed (an environment bug, or requests the server refuses)."""


@dataclass
class Group:
    order: int
    """Position in the step's task stream (keeps the batch layout independent of timing)."""
    task_id: str
    trajectories: list[Trajectory]
    advantages: list[float]


@dataclass
class StepBatch:
    step: int
    groups: list[Group]
    filtered_groups: int = 0
    failed_groups: int = 0
    zero_advantage_kept: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def samples(self, env_name: str) -> list[Sample]:
        """The transport's samples, with advantages and policy versions."""
        return [
            Sample(
                prompt_ids=t.prompt_ids,
                completion_ids=t.completion_ids,
                completion_mask=[bool(m) for m in t.completion_mask],
                completion_logprobs=t.completion_logprobs,
                reward=t.reward,
                advantage=a,
                policy_version=t.policy_version,
                task_id=t.task_id,
                env=env_name,
                metrics=t.metrics,
                policy_versions=t.weight_versions,
            )
            for g in self.groups
            for t, a in zip(g.trajectories, g.advantages, strict=True)
        ]


class RolloutCollector:
    def __init__(self, env: Environment, pool: ServerPool, cfg: OrchestratorConfig) -> None:
        self.env = env
        self.pool = pool
        self.cfg = cfg
        self.tasks = env.dataset("train")

    async def run_group(self, order: int, task: Any) -> Group:
        async with self.pool.lease() as client:
            trajectories = await self.env.rollout_group(task, client, self.cfg.sampling, self.cfg.group_size)
        if len(trajectories) != self.cfg.group_size:
            raise ValueError(f"returned {len(trajectories)} trajectories, expected {self.cfg.group_size}")
        for t in trajectories:
            if t.num_tokens > self.cfg.seq_len:
                raise ValueError(
                    f"a trajectory has {t.num_tokens} tokens, more than seq_len {self.cfg.seq_len}"
                )
        advantages = group_advantages([t.reward for t in trajectories], self.cfg.advantage.std_normalize)
        return Group(order, task.task_id, trajectories, advantages)

    async def collect(self, step: int) -> StepBatch:
        """Rollouts for `step` until `groups_per_step` groups are kept."""
        cfg = self.cfg
        need = cfg.groups_per_step
        batch = StepBatch(step=step, groups=[])
        order = enumerate(step_task_order(len(self.tasks), cfg.seed, step))
        pending: dict[asyncio.Task, str] = {}
        max_failures = 2 * need + 8

        def launch() -> None:
            position, index = next(order)
            task = self.tasks[index]
            pending[asyncio.ensure_future(self.run_group(position, task))] = task.task_id

        start = time.perf_counter()
        for _ in range(need):
            launch()
        try:
            while len(batch.groups) < need:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    task_id = pending.pop(future)
                    try:
                        group = future.result()
                    except ServerUnavailable:
                        raise
                    except Exception as e:
                        batch.failed_groups += 1
                        batch.errors.append(f"task {task_id}: {type(e).__name__}: {e}")
                        log.error(
                            "step %d: rollout of task %s failed: %s: %s", step, task_id, type(e).__name__, e
                        )
                        log.debug("traceback of task %s", task_id, exc_info=e)
                        if batch.failed_groups > max_failures:
                            raise RolloutsFailing(
                                f"step {step}: {batch.failed_groups} rollout groups failed; last: {batch.errors[-1]}"
                            ) from None
                        launch()
                        continue
                    if is_zero_advantage(group.advantages):
                        if (
                            cfg.filter_zero_advantage_groups
                            and batch.filtered_groups < cfg.max_filtered_groups
                        ):
                            batch.filtered_groups += 1
                            launch()
                            continue
                        batch.zero_advantage_kept += 1
                    batch.groups.append(group)
        finally:
            for future in pending:
                future.cancel()
        batch.groups.sort(key=lambda g: g.order)
        batch.seconds = time.perf_counter() - start
        return batch
