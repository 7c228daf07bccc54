"""The orchestrator's main loop: for each step, wait until the servers serve a recent enough
policy, collect a batch of scored groups, pack it per trainer rank and write rollouts/step_N.

Nothing here waits for the trainer except the `max_async_level` gate, so with level k the
orchestrator runs up to k steps ahead of training. A background task moves all servers to every
newly published version as soon as it appears (weights.py), through the last one. With
[monitor.wandb] another forwards metrics.jsonl to W&B (monitor/wandb_run.py), and the
orchestrator ends only once the trainer's last step has reached it.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from tandem.client.inference import ServerPool
from tandem.envs.base import Message
from tandem.envs.mixture import load_mixture, split_tasks
from tandem.models.loading import load_tokenizer
from tandem.monitor.metrics import MetricsWriter
from tandem.monitor.progress import TrainingProgress
from tandem.monitor.wandb_run import WandbRun, require_wandb, run_config
from tandem.orchestrator.collapse import CollapseWatch
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.evaluation import evaluate
from tandem.orchestrator.prompt_check import check_prompt_lengths
from tandem.orchestrator.rollouts import RolloutCollector, StepBatch
from tandem.orchestrator.stats import mean, per_env_stats, staleness_stats, trajectory_stats
from tandem.orchestrator.watchdog import LoopWatchdog
from tandem.orchestrator.weights import PolicySync
from tandem.transport.resume import check_fresh_start, orchestrator_start, trainer_start
from tandem.transport.rollouts import pack_samples, step_dir, write_step

log = logging.getLogger(__name__)
T = TypeVar("T")
STEPS_IN_FLIGHT = 2


def first_step(cfg: OrchestratorConfig) -> int:
    """0 for a fresh run (refused where rollouts exist); with `resume`, see transport/resume.py."""
    if not cfg.resume:
        check_fresh_start(cfg.run_dir)
        return 0
    return orchestrator_start(cfg.run_dir, cfg.trainer_shape)


def prompt_tokens(tokenizer: Any, messages: list[Message]) -> int:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return len(encoded["input_ids"])


def step_metrics(batch: StepBatch, waited: float, seconds: float) -> dict[str, float]:
    trajectories = batch.trajectories
    generated = sum(sum(t.completion_mask) for t in trajectories)
    advantages = [a for g in batch.groups for a in g.advantages]
    failed = {f"env/{name}/groups_failed": float(count) for name, count in batch.failed_by_env.items()}
    return {
        **trajectory_stats(trajectories),
        **per_env_stats(batch.by_env()),
        **failed,
        **staleness_stats(trajectories, batch.step),
        "advantage_abs_mean": mean([abs(a) for a in advantages]),
        "groups_filtered": float(batch.filtered_groups),
        "groups_failed": float(batch.failed_groups),
        "groups_zero_advantage_kept": float(batch.zero_advantage_kept),
        "rollout_tokens_per_s": generated / batch.seconds if batch.seconds > 0 else 0.0,
        "rollout_s": batch.seconds,
        "wait_weights_s": waited,
        "step_s": seconds,
        "num_samples": float(len(trajectories)),
    }


def rollout_rows(batch: StepBatch, tokenizer: Any, limit: int) -> list[dict[str, Any]]:
    """The first `limit` samples of a step as table rows, their token ids decoded as sent."""
    rows = []
    for sample in batch.samples()[:limit]:
        rows.append(
            {
                "step": batch.step,
                "env": sample.env,
                "task_id": sample.task_id,
                "prompt": tokenizer.decode(sample.prompt_ids),
                "completion": tokenizer.decode(sample.completion_ids),
                "reward": sample.reward,
                "advantage": sample.advantage,
                "policy_version": sample.policy_version,
            }
        )
    return rows


async def supervise(main: Awaitable[T], *helpers: Awaitable[object]) -> T:
    """Await `main` with `helpers` running beside it. Helpers may finish early; the first failure of
    any task cancels all others and is raised; helpers still running when `main` ends are cancelled."""
    main_task = asyncio.ensure_future(main)
    tasks = [main_task, *(asyncio.ensure_future(h) for h in helpers)]
    try:
        pending = set(tasks)
        while not main_task.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        return main_task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Launched:
    """A step whose rollouts are being collected."""

    step: int
    began: float
    waited: float
    collecting: asyncio.Future[StepBatch]


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        self.members = load_mixture(cfg.env, cfg.envs)
        self.pool = ServerPool(cfg.servers, cfg.client, weight_only=cfg.prefill_servers)
        self.policy = PolicySync(cfg.run_dir, self.pool, cfg.weights)
        self.collector = RolloutCollector(self.members, self.pool, cfg)
        if cfg.eval.interval > 0:
            for member in self.members:
                split_tasks(member, "eval")
        self.metrics = MetricsWriter(cfg.run_dir / "metrics.jsonl", source="orchestrator")
        self.wandb: WandbRun | None = None
        self.tokenizer: Any = None
        if cfg.monitor.wandb_enabled:
            require_wandb()
        self.collapse = CollapseWatch(cfg.eval.collapse_evals)

    async def run(self) -> None:
        """Connect, then run the steps with the weight watcher beside them; either failing stops both."""
        cfg = self.cfg
        failed = True
        watchdog = None
        try:
            start, retrain_from = first_step(cfg), trainer_start(cfg.run_dir)
            if start >= cfg.max_steps and retrain_from >= cfg.max_steps:
                log.info("all %d steps are already written and trained; nothing to do", cfg.max_steps)
                return
            self.tokenizer = tokenizer = load_tokenizer(cfg.model.name)
            for member in self.members:
                member.env.setup(tokenizer, cfg.seq_len)
                check_prompt_lengths(member.env, cfg, lambda m: prompt_tokens(tokenizer, m))
            # from here on the loop is shared (rollouts, requests, weight updates): the synchronous
            # start above blocks nothing, and a warning about it would only confuse
            watchdog = LoopWatchdog(asyncio.get_running_loop())
            watchdog.start()
            served = await self.pool.connect(cfg.seq_len)
            log.info("%d server(s) serving %s: %s", len(cfg.servers), served, ", ".join(cfg.servers))
            if cfg.prefill_servers:
                log.info("their prompts computed by: %s", ", ".join(cfg.prefill_servers))
            if cfg.monitor.wandb is not None and cfg.monitor.wandb_enabled:
                config = run_config(cfg.model_dump(mode="json"))
                self.wandb = WandbRun(cfg.monitor.wandb, cfg.run_dir, cfg.resume, config)
            await self.policy.sync()
            if start < cfg.max_steps:
                await supervise(self.steps(start), self.policy.watch(), *self.forwarders())
            else:  # the trainer retrains written steps: the servers still take each version it sends
                log.info(
                    "all %d steps are already written; the trainer retrains them from step %d",
                    cfg.max_steps,
                    retrain_from,
                )
            if cfg.eval.interval > 0:
                await supervise(self.final_eval(), self.policy.watch(), *self.forwarders())
            elif cfg.weights.in_memory:  # the trainer waits for the servers to take every version
                await self.policy.wait_for(cfg.max_steps, cfg.max_steps, 0)
            if self.wandb is not None:  # the trainer's last numbers go into the W&B run too
                await self.wandb.wait_for("trainer", cfg.max_steps - 1, cfg.weights.wait_timeout)
            failed = False
        finally:
            if watchdog is not None:
                watchdog.stop()
            await self.pool.close()
            self.metrics.close()
            if self.wandb is not None:
                self.wandb.finish(failed)

    def forwarders(self) -> list[Awaitable[None]]:
        return [self.wandb.forward()] if self.wandb is not None else []

    async def evaluate(self, step: int) -> None:
        stats = await evaluate(self.members, self.pool, self.cfg)
        stats["eval/policy_version"] = float(self.policy.version)
        self.metrics.log(step, **stats)
        metrics = {k[9:]: v for k, v in stats.items() if k.startswith("eval/env/") and "/" not in k[9:]}
        if len(self.members) > 1:
            metrics |= {f"{m.name} reward": stats[f"eval/env/{m.name}/reward_mean"] for m in self.members}
        log.info(
            "eval at step %d (policy %d): reward %.4f%s",
            step,
            self.policy.version,
            stats["eval/reward_mean"],
            "".join(f", {k} {v:.4f}" for k, v in metrics.items()),
        )
        if warning := self.collapse.evaluated(step, stats["eval/reward_mean"]):
            log.warning(warning)

    async def final_eval(self) -> None:
        """Evaluate the policy trained on every step (weights/step_{max_steps})."""
        await self.policy.wait_for(self.cfg.max_steps, self.cfg.max_steps, 0)
        await self.evaluate(self.cfg.max_steps)

    def eval_due(self, step: int) -> bool:
        return self.cfg.eval.interval > 0 and step % self.cfg.eval.interval == 0

    async def steps(self, start: int) -> None:
        """Two loops joined by a queue: `launch` gates step N on the policy version and starts
        collecting it; `write` finishes steps in order. At most two steps collect at once, so
        step N+1's requests already keep the servers busy while step N's last groups finish
        (whenever the gate allows step N+1 to start)."""
        cfg = self.cfg
        k = cfg.max_async_level
        log.info("orchestrating steps %d..%d with max_async_level %d", start, cfg.max_steps - 1, k)
        queue: asyncio.Queue[Launched | None] = asyncio.Queue()
        slots = asyncio.Semaphore(STEPS_IN_FLIGHT)
        launched: list[Launched] = []

        async def launch() -> None:
            for step in range(start, cfg.max_steps):
                await slots.acquire()
                began = time.perf_counter()
                waited = await self.policy.wait_for(step - k, step, k)
                if self.eval_due(step):
                    await self.evaluate(step)
                item = Launched(step, began, waited, asyncio.ensure_future(self.collector.collect(step)))
                launched.append(item)
                await queue.put(item)
            await queue.put(None)

        async def write(progress: TrainingProgress) -> None:
            while (item := await queue.get()) is not None:
                self.write_step(item.step, await item.collecting, item, progress)
                slots.release()

        try:
            with TrainingProgress(cfg.max_steps, start=start, log_interval=1, index_steps=True) as progress:
                await supervise(write(progress), launch())
        finally:
            for item in launched:
                item.collecting.cancel()
            await asyncio.gather(*(item.collecting for item in launched), return_exceptions=True)

    def write_step(self, step: int, batch: StepBatch, item: Launched, progress: TrainingProgress) -> None:
        cfg = self.cfg
        oldest_allowed = step - cfg.max_async_level
        stale = [t for t in batch.trajectories if t.policy_version < oldest_allowed]
        if stale:
            log.warning("step %d: %d samples older than policy %d", step, len(stale), oldest_allowed)
        per_group = pack_samples(
            batch.samples(),
            cfg.seq_len,
            cfg.num_ranks // cfg.cp,
            cfg.micro_batch_tokens,
            step=step,
            temperature=cfg.sampling.temperature,
            width_multiple=cfg.width_multiple,
            share_prompts=cfg.share_prompts,
        )
        write_step(cfg.run_dir, step, per_group, cp=cfg.cp)
        stats = step_metrics(batch, item.waited, time.perf_counter() - item.began)
        self.metrics.log(step, **stats)
        if self.wandb is not None and self.wandb.samples_due(step):
            rows = rollout_rows(batch, self.tokenizer, self.wandb.cfg.sample_rows)
            self.wandb.log_table("rollouts", step, rows)
        self.collapse.add(batch.trajectories)
        log.debug("wrote %s", step_dir(cfg.run_dir, step))
        progress.update(
            step + 1,
            {
                "reward": stats["reward_mean"],
                "len": stats["completion_len_mean"],
                "stale": stats["staleness_mean"],
                "tok/s": stats["rollout_tokens_per_s"],
                "wait": stats["wait_weights_s"],
            },
        )
