"""The orchestrator's main loop: for each step, wait until the servers serve a recent enough
policy, collect a batch of scored groups, pack it per trainer rank and write rollouts/step_N.

Nothing here waits for the trainer except the `max_async_level` gate, so with level k the
orchestrator runs up to k steps ahead of training. A background task pushes every newly
published `weights/step_N` to all servers as soon as its STABLE marker appears.
"""

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from tandem.cli import UserError
from tandem.envs.base import Environment, SingleTurnEnv
from tandem.envs.registry import load_environment
from tandem.models.loading import load_tokenizer
from tandem.monitor.metrics import MetricsWriter
from tandem.monitor.progress import TrainingProgress
from tandem.orchestrator.client import ServerPool
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.evaluation import evaluate
from tandem.orchestrator.rollouts import RolloutCollector, StepBatch
from tandem.orchestrator.stats import mean, staleness_stats, trajectory_stats
from tandem.orchestrator.weights import PolicySync
from tandem.transport.rollouts import pack_samples, step_dir, write_step

log = logging.getLogger(__name__)
PROMPT_CHECK_LIMIT = 5000


def written_steps(run_dir: Path) -> list[int]:
    """Steps whose rollouts are completely written (their READY marker exists), ascending."""
    root = run_dir / "rollouts"
    if not root.is_dir():
        return []
    steps = [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / "READY").is_file()]
    return sorted(steps)


def first_step(cfg: OrchestratorConfig) -> int:
    """0 for a fresh run; after the last complete step with `resume`. Refuses to overwrite a run."""
    done = written_steps(cfg.run_dir)
    if not cfg.resume:
        if done:
            raise UserError(
                f"{cfg.run_dir / 'rollouts'} already holds steps up to {done[-1]}: pass --resume to "
                "continue that run, or choose a new run_dir"
            )
        return 0
    return done[-1] + 1 if done else 0


def check_prompt_lengths(env: Environment, cfg: OrchestratorConfig) -> None:
    """Fail at start when the longest prompt plus max_tokens cannot fit in seq_len."""
    if not isinstance(env, SingleTurnEnv):
        return
    tokenizer = load_tokenizer(cfg.model.name)
    tasks = list(env.dataset("train"))[:PROMPT_CHECK_LIMIT] + list(env.dataset("eval"))[: cfg.eval.num_tasks]
    longest, task_id = 0, ""
    for task in tasks:
        ids = tokenizer.apply_chat_template(env.prompt(task), add_generation_prompt=True, tokenize=True)
        n = len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if n > longest:
            longest, task_id = n, task.task_id
    if longest + cfg.sampling.max_tokens > cfg.seq_len:
        raise UserError(
            f"seq_len {cfg.seq_len} cannot fit one sample: prompt of task {task_id} has {longest} tokens "
            f"+ sampling.max_tokens {cfg.sampling.max_tokens}"
        )


def step_metrics(
    batch: StepBatch, cfg: OrchestratorConfig, waited: float, seconds: float
) -> dict[str, float]:
    trajectories = batch.trajectories
    generated = sum(sum(t.completion_mask) for t in trajectories)
    advantages = [a for g in batch.groups for a in g.advantages]
    return {
        **trajectory_stats(trajectories),
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


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        self.env = load_environment(cfg.env.name, cfg.env.args)
        self.env.name = self.env.name or cfg.env.name
        self.pool = ServerPool(cfg.servers, cfg.client)
        self.policy = PolicySync(cfg.run_dir, self.pool, cfg.weights)
        self.collector = RolloutCollector(self.env, self.pool, cfg)
        self.metrics = MetricsWriter(cfg.run_dir / "metrics.jsonl", source="orchestrator")

    async def run(self) -> None:
        """Connect, then run the step loop with the weight watcher beside it; either failing stops both."""
        try:
            start = first_step(self.cfg)
            if start >= self.cfg.max_steps:
                log.info("all %d steps are already written; nothing to do", self.cfg.max_steps)
                return
            check_prompt_lengths(self.env, self.cfg)
            await self.pool.connect()
            await self.policy.sync()
            loop = asyncio.ensure_future(self.steps(start))
            watcher = asyncio.ensure_future(self.policy.watch())
            try:
                await asyncio.wait({loop, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher.done():
                    watcher.result()
                loop.result()
            finally:
                for future in (loop, watcher):
                    future.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await future
        finally:
            await self.pool.close()
            self.metrics.close()

    async def evaluate(self, step: int) -> None:
        stats = await evaluate(self.env, self.pool, self.cfg)
        stats["eval/policy_version"] = float(self.policy.version)
        self.metrics.log(step, **stats)
        log.info(
            "eval at step %d (policy %d): reward %.4f%s",
            step,
            self.policy.version,
            stats["eval/reward_mean"],
            "".join(f", {k[9:]} {v:.4f}" for k, v in stats.items() if k.startswith("eval/env/")),
        )

    def eval_due(self, step: int) -> bool:
        return self.cfg.eval.interval > 0 and step % self.cfg.eval.interval == 0

    async def steps(self, start: int) -> None:
        cfg = self.cfg
        k = cfg.max_async_level
        log.info("orchestrating steps %d..%d with max_async_level %d", start, cfg.max_steps - 1, k)
        with TrainingProgress(cfg.max_steps, start=start, log_interval=1) as progress:
            for step in range(start, cfg.max_steps):
                began = time.perf_counter()
                waited = await self.policy.wait_for(step - k, step, k)
                if self.eval_due(step):
                    await self.evaluate(step)
                batch = await self.collector.collect(step)
                stale = [t for t in batch.trajectories if t.policy_version < step - k]
                if stale:
                    log.warning("step %d: %d samples older than policy %d", step, len(stale), step - k)
                per_rank = pack_samples(
                    batch.samples(self.env.name),
                    cfg.seq_len,
                    cfg.num_ranks,
                    cfg.micro_batch_tokens,
                    step=step,
                    temperature=cfg.sampling.temperature,
                )
                write_step(cfg.run_dir, step, per_rank)
                stats = step_metrics(batch, cfg, waited, time.perf_counter() - began)
                self.metrics.log(step, **stats)
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
        if cfg.eval.interval > 0:
            await self.policy.wait_for(cfg.max_steps, cfg.max_steps, 0)
            await self.evaluate(cfg.max_steps)
