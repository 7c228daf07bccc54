"""The RL loop: rollouts/step_N → importance-weighted loss → AdamW step → weights/step_{N+1}.

Policy version = optimizer steps taken. The base model is version 0; trainer step N (0-based)
reads `rollouts/step_N/rank_R.bin`, takes one optimizer step and publishes version N+1 by the
weight transport (`weights/step_{N+1}` on disk, or streamed from memory: weight_publisher.py). Metrics of step N are logged with `step = N`, the same number the
orchestrator uses for the rollouts it wrote, so rewards and losses line up.

Each data-parallel group reads its own micro-batches (the orchestrator balanced them and gave
every group the same count); under context parallelism the cp ranks of a group read the same
file and each computes its own columns of it. Micro-batch losses (over this rank's tokens) are
divided by the step's global loss-token count; FSDP2 averages gradients over ranks, so each rank
scales its loss by world_size to get the sum.
"""

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.config.base import cp_width_multiple
from tandem.models.context_parallel import token_view
from tandem.models.loading import load_tokenizer
from tandem.monitor.metrics import MetricsWriter
from tandem.monitor.progress import TrainingProgress
from tandem.trainer.checkpoint import checkpoint_to_resume, save_checkpoint
from tandem.trainer.expert_load import expert_load
from tandem.trainer.optim import clip_grad_norm
from tandem.trainer.parallel import World, all_reduce_sum, data_shard, distributed
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.loss import LossInputs, LossStats, SampleTokens, build_objective, policy_loss
from tandem.trainer.training_state import build_training_state
from tandem.trainer.weight_publisher import PolicyPublisher
from tandem.transport.layout import CHECKPOINTS
from tandem.transport.rollouts import MicroBatch, RolloutError, prune_steps, read_rank, shares_prompts


def micro_batch_loss(
    model: nn.Module,
    objective: Any,
    mb: MicroBatch,
    cfg: RLTrainerConfig,
    device: torch.device,
) -> tuple[torch.Tensor, LossStats]:
    if cfg.loss.normalize == "sample" and mb.num_loss_samples is None:
        raise RolloutError(
            f"rollouts/step_{mb.step} do not record their number of samples (written by an older tandem), "
            "which loss.normalize = 'sample' divides by: train them with normalize = 'token', or delete them "
            "and resume (the orchestrator writes them again)"
        )
    logprobs, entropy = model.sequence_logprobs(
        mb.input_ids.to(device), mb.position_ids.to(device), mb.temperature, cfg.logprob_chunk_size
    )
    mine = token_view(model)
    inputs = LossInputs(
        logprobs=logprobs,
        sampler_logprobs=mine(mb.sampler_logprobs.to(device)),
        advantages=mine(mb.advantages.to(device)),
        loss_mask=mine(mb.loss_mask.to(device)),
        entropy=entropy,  # differentiable: a custom objective may add an entropy bonus
        samples=sample_tokens(model, mb, device),
    )
    return policy_loss(objective, cfg.loss, inputs, mb.num_loss_tokens, mb.num_loss_samples)


def sample_tokens(model: nn.Module, mb: MicroBatch, device: torch.device) -> SampleTokens:
    """The micro-batch's tokens' samples, as `model.sequence_logprobs` sees the tokens (this rank's
    columns under context parallelism, whose group then adds up the samples' sums)."""
    loss_tokens = torch.zeros(max(int(mb.sample_index.max()), 0) + 1, dtype=torch.float64)
    for meta in mb.samples:
        loss_tokens[meta.index] = meta.num_loss_tokens
    cp = getattr(model, "context_parallel", None)
    index = token_view(model)(mb.sample_index.to(device))
    return SampleTokens(index, loss_tokens.to(device), None if cp is None else cp.group)


def check_micro_batches(
    micro_batches: list[MicroBatch], vocab_size: int, cfg: RLTrainerConfig, step: int
) -> None:
    """Fail clearly on ids the embedding cannot look up (on GPU that would be a device assert) and
    on rows wider than seq_len (rounded up to what context parallelism pads to)."""
    if cfg.seq_len is not None:
        multiple = cp_width_multiple(cfg.parallel.cp, cfg.parallel.cp_style)
        limit = -(-cfg.seq_len // multiple) * multiple
        widest = max(mb.input_ids.shape[1] for mb in micro_batches)
        if widest > limit:
            raise RolloutError(
                f"rollouts/step_{step}: a micro-batch is {widest} tokens wide, longer than seq_len "
                f"{cfg.seq_len} (rollouts packed for another seq_len?)"
            )
    for mb in micro_batches:
        low, high = int(mb.input_ids.min()), int(mb.input_ids.max())
        if low < 0 or high >= vocab_size:
            raise RolloutError(
                f"rollouts/step_{step}: token ids span [{low}, {high}], outside the model's vocabulary "
                f"of {vocab_size} (rollouts from a different model?)"
            )


def attend_shared_prompts(model: nn.Module, micro_batches: list[MicroBatch], step: int) -> None:
    """Tell the model whether this step's rows hold shared prompts; refuse them if it cannot."""
    shared = any(shares_prompts(mb.position_ids) for mb in micro_batches)
    if shared and not getattr(model, "supports_shared_prompts", False):
        raise RolloutError(
            f"rollouts/step_{step} share prompts between samples (orchestrator.share_prompts), which "
            "this trainer's model cannot attend: that needs model.impl = 'tandem' with attention 'sdpa', "
            "'flex' or 'auto', no context parallelism, and not GLM-5; set orchestrator.share_prompts = false"
        )
    if hasattr(model, "shared_prompts"):
        model.shared_prompts = shared


def sample_stats(
    micro_batches: list[MicroBatch], step: int, counted: bool = True
) -> tuple[list[float], float]:
    """Local sums [samples, reward, staleness, tokens] and the maximum staleness; sums are 0 where
    not `counted` (the other ranks of a cp group, which hold the same samples)."""
    samples = [s for mb in micro_batches for s in mb.samples]
    staleness = [step - s.policy_version for s in samples]
    tokens = sum(mb.num_tokens for mb in micro_batches)
    sums = [len(samples), sum(s.reward for s in samples), sum(staleness), tokens]
    return [x * counted for x in sums], max(staleness, default=0)


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """Maximum of a small tensor over ranks (in place) and return it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def train_step(
    model: nn.Module,
    objective: Any,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    step: int,
    cfg: RLTrainerConfig,
    world: World,
) -> dict[str, float]:
    """Forward/backward every micro-batch of this rank, clip, step; returns global statistics."""
    local = LossStats.zeros(world.device)
    for mb in micro_batches:
        loss, stats = micro_batch_loss(model, objective, mb, cfg, world.device)
        (loss * world.size).backward()
        local.add(stats)
    grad_norm = clip_grad_norm(optimizer, cfg.optim.max_grad_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    totals = LossStats(all_reduce_sum(local.sums), all_reduce_max(local.max_abs_log_ratio))
    counts, max_staleness = sample_stats(micro_batches, step, counted=world.rank % cfg.parallel.cp == 0)
    counts = all_reduce_sum(torch.tensor(counts, dtype=torch.float64, device=world.device))
    n, reward, staleness, tokens = counts.tolist()
    return {
        **totals.means(),
        "grad_norm": float(grad_norm),
        "lr": lr,
        "samples": int(n),
        "reward": reward / max(n, 1),
        "staleness": staleness / max(n, 1),
        "max_staleness": float(all_reduce_max(torch.tensor(float(max_staleness), device=world.device))),
        "tokens": int(tokens),
    }


def train(cfg: RLTrainerConfig) -> dict[str, Any]:
    """Run the RL trainer (single process or one torchrun rank); returns the last step's stats."""
    with distributed(cfg.model.device) as world:
        return _train(cfg, world)


def _train(cfg: RLTrainerConfig, world: World) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    ckpt_root = cfg.run_dir / CHECKPOINTS
    resume_from = checkpoint_to_resume(ckpt_root, cfg.resume, world, "trainer")
    objective = build_objective(cfg.loss)
    tokenizer = load_tokenizer(cfg.model.name)
    state = build_training_state(cfg, world, resume_from)
    model, optimizer, scheduler, start = state.model, state.optimizer, state.scheduler, state.step
    if resume_from and world.is_main:
        print(f"trainer: resumed from {resume_from} (next step {start})", flush=True)

    passes = 2 if cfg.parallel.recomputes else 1
    group, groups = data_shard(world, cfg.parallel.cp)
    publisher = PolicyPublisher(cfg.weights, cfg.run_dir, tokenizer, world, cfg.max_steps)
    publisher.start(model, start)
    metrics = MetricsWriter(cfg.run_dir / "metrics.jsonl", "trainer", enabled=world.is_main)
    progress = TrainingProgress(cfg.max_steps, start, log_interval=1, enabled=world.is_main, index_steps=True)
    stats: dict[str, Any] = {}
    with metrics, progress, contextlib.closing(publisher):
        for step in range(start, cfg.max_steps):
            wait_start = time.monotonic()
            micro_batches = read_rank(
                cfg.run_dir, step, group, cfg.rollout_timeout_s, num_ranks=groups, cp=cfg.parallel.cp
            )
            check_micro_batches(micro_batches, model.hf_config.vocab_size, cfg, step)
            attend_shared_prompts(model, micro_batches, step)
            compute_start = time.monotonic()
            stats = train_step(model, objective, optimizer, micro_batches, step, cfg, world)
            stats.update(expert_load(model, passes))
            scheduler.step()
            compute_s = time.monotonic() - compute_start
            publisher.publish(model, step + 1)
            last = step + 1 == cfg.max_steps and cfg.ckpt.final
            checkpoint_now = bool(cfg.ckpt.interval) and ((step + 1) % cfg.ckpt.interval == 0 or last)
            if checkpoint_now:
                save_checkpoint(ckpt_root, step + 1, model, optimizer, scheduler, world, keep=cfg.ckpt.keep)
            if cfg.prune_rollouts and world.is_main and (checkpoint_now or not cfg.ckpt.interval):
                prune_steps(cfg.run_dir, before=step)  # the last trained step stays: the run's marker
            stats.update(
                policy_version=step + 1,
                tokens_per_s=stats["tokens"] / compute_s,
                compute_s=compute_s,
                rollout_wait_s=compute_start - wait_start,
                publish_s=time.monotonic() - compute_start - compute_s,
            )
            metrics.log(step, **stats)
            progress.update(
                step + 1, {k: stats[k] for k in ("loss", "reward", "mismatch_kl", "tokens_per_s")}
            )
    return stats
