"""Collect one step's batch: groups of rollouts, scored, with group-relative advantages.

A step needs `batch_size / group_size` groups, split between the run's environments by weight
(`mixture.allocate`). All of them are requested at once, each from the least-loaded server. A
group fails when its environment raises (CancelledError too, unless the group itself was
cancelled), takes longer than `rollout_timeout`, or returns a malformed trajectory
(`check_trajectory`); it is logged with its environment, task id and reason and replaced by the
next task of the same environment, and so is a zero-advantage group when filtering is on. An
environment runs in a task of its own: cancelled (timed out, or its group cancelled), it gets
CANCEL_GRACE_S to finish; one that ignores the cancellation is abandoned still running, so
neither its group nor whoever cancelled the group waits for it. The
tasks of step N come from `step_task_order(seed, N)`, one stream per environment; with
`seeded_sampling` each group's requests carry a seed of that same place (seeds.py), so neither
depends on timing.
"""

import asyncio
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.cli import UserError
from tandem.client.config import SamplingConfig
from tandem.client.inference import InferenceClient, ServerPool, ServerUnavailable
from tandem.client.seeds import group_seed
from tandem.envs.base import Environment, Trajectory
from tandem.envs.mixture import Member, allocate, split_tasks
from tandem.orchestrator.advantages import group_advantages, is_zero_advantage
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.tasks import step_task_order
from tandem.transport.rollouts import Sample

log = logging.getLogger(__name__)


class RolloutsFailing(UserError):
    """Too many rollouts of one step failed (an environment bug, or requests the server refuses)."""


class MalformedTrajectory(ValueError):
    """An environment returned a trajectory the trainer cannot use."""


class RolloutTimeout(TimeoutError):
    """A group's rollouts did not finish within `rollout_timeout`."""


class EnvironmentCancelled(RuntimeError):
    """An environment raised CancelledError while nothing cancelled its group."""


def check_trajectory(t: Trajectory, task_id: str, seq_len: int) -> None:
    """Raise MalformedTrajectory naming the first problem of `t`."""
    if t.task_id != task_id:
        raise MalformedTrajectory(f"trajectory of task {t.task_id!r} returned for task {task_id!r}")
    for name in ("prompt_ids", "completion_ids", "completion_mask", "completion_logprobs", "weight_versions"):
        value = getattr(t, name)
        if not isinstance(value, list):
            raise MalformedTrajectory(f"{name} must be a list, not {type(value).__name__}")
    n = len(t.completion_ids)
    if not t.prompt_ids:
        raise MalformedTrajectory("empty prompt_ids")
    if len(t.completion_mask) != n or len(t.completion_logprobs) != n:
        raise MalformedTrajectory(
            f"{n} completion_ids but {len(t.completion_mask)} mask values and "
            f"{len(t.completion_logprobs)} logprobs"
        )
    ids = [*t.prompt_ids, *t.completion_ids]
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise MalformedTrajectory("token ids must be non-negative integers")
    if any(m not in (0, 1) for m in t.completion_mask) or sum(t.completion_mask) < 1:
        raise MalformedTrajectory("completion_mask must be 0/1 with at least one sampled token")
    if not all(isinstance(v, int) and v >= 0 for v in t.weight_versions):
        raise MalformedTrajectory(f"weight_versions {t.weight_versions!r} must be non-negative integers")
    if not isinstance(t.turns, list) or not all(
        isinstance(x, dict) and "finish_reason" in x for x in t.turns
    ):
        raise MalformedTrajectory("turns must be a list of dicts with a finish_reason")
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in t.completion_logprobs):
        raise MalformedTrajectory("completion_logprobs must be finite numbers")
    if not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
        raise MalformedTrajectory(f"reward {t.reward!r} is not a finite number")
    bad = [k for k, v in t.metrics.items() if not isinstance(v, int | float) or not math.isfinite(v)]
    if bad:
        raise MalformedTrajectory(f"metric {bad[0]!r} = {t.metrics[bad[0]]!r} is not a finite number")
    if t.num_tokens > seq_len:
        raise MalformedTrajectory(f"{t.num_tokens} tokens, more than seq_len {seq_len}")


CANCEL_GRACE_S = 5.0
"""How long a cancelled environment may take to finish: enough for cleanup that awaits (closing
an HTTP stream or a sandbox), short enough that a step is not held up much by an environment that
catches CancelledError and goes on (a bare `except BaseException:`, a retry loop that catches
everything): that one is abandoned instead of waited for."""

ABANDONED: set[asyncio.Task] = set()
"""Environment tasks that ignored their cancellation and still run: the event loop keeps only weak
references to tasks, and one collected mid-flight would vanish without a trace."""


async def play_group(
    env: Environment,
    task: Any,
    client: InferenceClient,
    sampling: SamplingConfig,
    n: int,
    timeout: float,
    seq_len: int,
) -> list[Trajectory]:
    """`n` checked trajectories of one task; raises RolloutTimeout, MalformedTrajectory,
    EnvironmentCancelled or what the environment raised. Cancelled itself, it cancels the
    environment and returns (raising CancelledError) within CANCEL_GRACE_S whatever it does."""
    playing = asyncio.ensure_future(env.rollout_group(task, client, sampling, n))
    playing.set_name(f"rollout of env {env.name or type(env).__name__} task {task.task_id}")
    try:
        done, _ = await asyncio.wait([playing], timeout=timeout)
    except asyncio.CancelledError:  # this group was cancelled: the environment too, then pass it on
        await stop(playing, env, task.task_id)
        raise
    if not done:
        if await stop(playing, env, task.task_id):
            raise RolloutTimeout(f"no result within rollout_timeout ({timeout:g}s)")
        raise RolloutTimeout(
            f"no result within rollout_timeout ({timeout:g}s), and the environment ignored "
            f"cancellation: its rollout still ran {CANCEL_GRACE_S:g}s after being cancelled and was abandoned"
        )
    if playing.cancelled():
        # the environment's own (it awaited something cancelled elsewhere): a failure of this group,
        # not a cancellation of the step that would end the run
        raise EnvironmentCancelled(
            "the environment raised CancelledError without being cancelled "
            "(it awaited a task or future that was cancelled)"
        )
    trajectories = playing.result()  # or what the environment raised (its own TimeoutError included)
    if len(trajectories) != n:
        raise MalformedTrajectory(f"returned {len(trajectories)} trajectories, expected {n}")
    for t in trajectories:
        check_trajectory(t, task.task_id, seq_len)
    return trajectories


async def stop(playing: asyncio.Task, env: Environment, task_id: str) -> bool:
    """Cancel an environment's rollout and wait up to CANCEL_GRACE_S for it to end; True when it
    did. Otherwise it is abandoned: kept in ABANDONED until it ends on its own, and logged once.
    Cancelled again meanwhile (the process shutting down), it still waits out the grace, so that
    a rollout cleaning up is not taken for one ignoring cancellation, then raises CancelledError."""
    playing.cancel()
    began = time.monotonic()
    cancelled = False
    while not playing.done() and (left := began + CANCEL_GRACE_S - time.monotonic()) > 0:
        try:
            await asyncio.wait([playing], timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    if not playing.done():
        abandon(playing, env, task_id, time.monotonic() - began)
    elif not playing.cancelled():
        playing.exception()  # what it raised on its way out is not this group's reason: retrieved
    if cancelled:
        raise asyncio.CancelledError
    return playing.done()


def abandon(playing: asyncio.Task, env: Environment, task_id: str, waited: float) -> None:
    name = env.name or type(env).__name__
    log.warning(
        "environment %s ignored cancellation: its rollout of task %s still runs %.1fs after being "
        "cancelled and is abandoned (it catches CancelledError and goes on awaiting; let "
        "CancelledError propagate, or re-raise it after cleaning up)",
        name,
        task_id,
        waited,
    )
    ABANDONED.add(playing)

    def ended(done: asyncio.Task) -> None:
        ABANDONED.discard(done)
        if not done.cancelled():
            done.exception()  # retrieved: nobody awaits an abandoned rollout
        log.info("the abandoned rollout of env %s task %s ended", name, task_id)

    playing.add_done_callback(ended)


@dataclass
class Group:
    env: str
    order: tuple[int, int]
    """(environment index, position in its task stream): keeps the batch layout independent of timing."""
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
    failed_by_env: dict[str, int] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def by_env(self) -> dict[str, list[Trajectory]]:
        """Trajectories per environment name, in batch order."""
        out: dict[str, list[Trajectory]] = {}
        for g in self.groups:
            out.setdefault(g.env, []).extend(g.trajectories)
        return out

    def samples(self) -> list[Sample]:
        """The transport's samples, with advantages, policy versions and environment names."""
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
                env=g.env,
                metrics=t.metrics,
                policy_versions=t.weight_versions,
            )
            for g in self.groups
            for t, a in zip(g.trajectories, g.advantages, strict=True)
        ]


def as_members(envs: Environment | Sequence[Member]) -> list[Member]:
    if isinstance(envs, Environment):
        return [Member(envs.name or "env", envs)]
    return list(envs)


class RolloutCollector:
    def __init__(
        self, envs: Environment | Sequence[Member], pool: ServerPool, cfg: OrchestratorConfig
    ) -> None:
        self.members = as_members(envs)
        self.pool = pool
        self.cfg = cfg
        self.tasks = [split_tasks(m, "train") for m in self.members]

    def sampling(self, step: int, order: tuple[int, int], member: Member, task: Any) -> SamplingConfig:
        """The group's sampling: with seeded_sampling, seeded by where the group sits in the run."""
        cfg = self.cfg
        if not cfg.seeded_sampling:
            return cfg.sampling
        seed = group_seed(cfg.seed, step, member.name, order[1], task.task_id)
        return cfg.sampling.model_copy(update={"request_seed": seed})

    async def run_group(self, step: int, order: tuple[int, int], member: Member, task: Any) -> Group:
        cfg = self.cfg
        sampling = self.sampling(step, order, member, task)
        async with self.pool.lease() as client:
            trajectories = await play_group(
                member.env, task, client, sampling, cfg.group_size, cfg.rollout_timeout, cfg.seq_len
            )
        advantages = group_advantages([t.reward for t in trajectories], cfg.advantage.std_normalize)
        return Group(member.name, order, task.task_id, trajectories, advantages)

    def streams(self, step: int) -> list[Iterator[tuple[int, int]]]:
        """Per environment, (position, dataset index) of its tasks for `step`. A single environment
        keeps the unsalted order, so its runs draw the same tasks as before mixing existed."""
        salt = len(self.members) > 1
        return [
            enumerate(step_task_order(len(tasks), self.cfg.seed, step, m.name if salt else ""))
            for m, tasks in zip(self.members, self.tasks, strict=True)
        ]

    async def collect(self, step: int) -> StepBatch:
        """Rollouts for `step` until every environment has its share of `groups_per_step` groups."""
        cfg = self.cfg
        batch = StepBatch(step=step, groups=[])
        counts = allocate([m.weight for m in self.members], cfg.groups_per_step, cfg.seed, step)
        streams = self.streams(step)
        pending: dict[asyncio.Task, tuple[int, str]] = {}
        max_failures = 2 * cfg.groups_per_step + 8

        def launch(e: int) -> None:
            position, index = next(streams[e])
            task = self.tasks[e][index]
            future = asyncio.ensure_future(self.run_group(step, (e, position), self.members[e], task))
            pending[future] = (e, task.task_id)

        start = time.perf_counter()
        for e, count in enumerate(counts):
            for _ in range(count):
                launch(e)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    e, task_id = pending.pop(future)
                    name = self.members[e].name
                    try:
                        group = future.result()
                    except ServerUnavailable as down:  # the run stops, naming the group it stopped at
                        raise ServerUnavailable(
                            f"step {step}: rollout of {self.where(name, task_id)}: {down}"
                        ) from None
                    except Exception as error:
                        self.record_failure(batch, name, task_id, error, max_failures)
                        launch(e)
                        continue
                    if is_zero_advantage(group.advantages):
                        if (
                            cfg.filter_zero_advantage_groups
                            and batch.filtered_groups < cfg.max_filtered_groups
                        ):
                            batch.filtered_groups += 1
                            launch(e)
                            continue
                        batch.zero_advantage_kept += 1
                    batch.groups.append(group)
        finally:
            for future in pending:
                future.cancel()
        batch.groups.sort(key=lambda g: g.order)
        batch.seconds = time.perf_counter() - start
        return batch

    def where(self, env: str, task_id: str) -> str:
        """A group as logs name it: its task, and its environment when the run mixes several."""
        return f"task {task_id}" if len(self.members) == 1 else f"env {env} task {task_id}"

    def record_failure(
        self, batch: StepBatch, env: str, task_id: str, error: Exception, max_failures: int
    ) -> None:
        """Log a failed group with its environment, task and reason; give up after too many."""
        batch.failed_groups += 1
        batch.failed_by_env[env] = batch.failed_by_env.get(env, 0) + 1
        reason = f"{type(error).__name__}: {error}"
        where = self.where(env, task_id)
        batch.errors.append(f"{where}: {reason}")
        log.error("step %d: rollout of %s failed: %s", batch.step, where, reason)
        log.debug("traceback of %s", where, exc_info=error)
        if batch.failed_groups > max_failures:
            raise RolloutsFailing(
                f"step {batch.step}: {batch.failed_groups} rollout groups failed; last: {batch.errors[-1]}"
            )
