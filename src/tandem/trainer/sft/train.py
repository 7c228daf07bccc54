"""The SFT loop: packed micro-batches → token-normalised loss → clipped AdamW step.

Every rank builds the same global batch (data order is a pure function of the position), packs
it into rows of seq_len, and its data-parallel group takes its round-robin share of the rows
(under context parallelism the cp ranks of a group share rows, each computing its own columns
of them). The loss is the sum of token cross-entropies over the global batch divided by its
number of loss tokens; since FSDP2 averages gradients over ranks, each rank scales its partial
sum (over its own tokens) by world_size / global tokens.
"""

import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.cli import UserError
from tandem.models.context_parallel import token_view
from tandem.models.loading import load_tokenizer
from tandem.monitor.metrics import MetricsWriter
from tandem.monitor.progress import TrainingProgress
from tandem.trainer.checkpoint import TRAINER_STATE, checkpoint_to_resume, save_checkpoint
from tandem.trainer.expert_load import expert_load
from tandem.trainer.hf_export import write_hf_model
from tandem.trainer.model import lora_enabled
from tandem.trainer.optim import clip_grad_norm
from tandem.trainer.packing import MicroBatch, make_micro_batches, pack_rows, shard_rows
from tandem.trainer.parallel import World, all_reduce_sum, barrier, data_shard, distributed
from tandem.trainer.sft.config import SFTConfig
from tandem.trainer.sft.data import SFTDataset, build_dataset
from tandem.trainer.sft.evaluation import evaluate_held_out
from tandem.trainer.training_state import build_training_state
from tandem.transport.layout import CHECKPOINTS


def token_loss_sum(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Sum of next-token cross-entropies (fp32) over the batch's loss tokens (this rank's, under
    context parallelism), through the chunked output head (layers/chunked_head.py): the full
    [tokens, vocab] logits never exist at once. A row's first token is never a loss token."""
    logprobs, _ = model.sequence_logprobs(batch.input_ids, batch.position_ids)
    return -logprobs[token_view(model)(batch.loss_mask)].sum()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: SFTDataset,
    position: int,
    cfg: SFTConfig,
    world: World,
) -> dict[str, float]:
    """One optimizer step on the global batch at `position`; returns its statistics."""
    samples = dataset.batch(position, cfg.data.batch_size)
    loss_tokens = sum(s.num_loss_tokens for s in samples)
    group, groups = data_shard(world, cfg.parallel.cp)
    rows, num_micro = shard_rows(pack_rows(samples, cfg.seq_len), group, groups, cfg.data.micro_batch_size)
    pad_id = dataset.tokenizer.pad_token_id or 0
    loss_sum = torch.zeros((), device=world.device)
    for batch in make_micro_batches(rows, cfg.seq_len, pad_id, cfg.data.micro_batch_size, num_micro):
        partial = token_loss_sum(model, batch.to(world.device))
        (partial * (world.size / loss_tokens)).backward()
        loss_sum += partial.detach()
    grad_norm = clip_grad_norm(optimizer, cfg.optim.max_grad_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = float(all_reduce_sum(loss_sum)) / loss_tokens
    tokens = sum(len(s.input_ids) for s in samples)
    return {
        "loss": loss,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
    }


def prepare_model_source(cfg: SFTConfig, world: World) -> None:
    """Build the tiny random model at model.name on first use, when the config asks for it."""
    if not cfg.init_tiny_model or Path(cfg.model.name).expanduser().exists():
        return
    if world.is_main:
        from tandem.models.tiny import TinyModelConfig, build_tiny_model

        build_tiny_model(TinyModelConfig(**cfg.tiny.model_dump(), out=Path(cfg.model.name).expanduser()))
        print(f"sft: built a random-init tiny Qwen3 at {cfg.model.name}", flush=True)
    barrier()


def data_identity(cfg: SFTConfig, dataset: SFTDataset) -> dict[str, Any]:
    """What fixes the example at every data position: a resumed run must read the same."""
    identity: dict[str, Any] = {
        "data.task": cfg.data.task,
        "seed": cfg.seed,
        "data.shuffle": cfg.data.shuffle,
        "data.num_examples": cfg.data.num_examples,
        "examples": len(dataset),
    }
    if cfg.data.task == "chat_jsonl":
        assert cfg.data.path is not None
        with cfg.data.path.open("rb") as f:
            identity["data.path contents (sha256)"] = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    else:
        identity.update({"data.min_len": cfg.data.min_len, "data.max_len": cfg.data.max_len})
    return identity


def check_resume_data(path: Path, identity: dict[str, Any]) -> None:
    """Resuming on other data (another seed, file or order) would continue at the saved position of
    a different sequence: fail, naming what changed (checkpoints from before this record pass)."""
    saved = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)["extra"].get("data")
    for key, value in (saved or {}).items():
        if identity.get(key) != value:
            raise UserError(
                f"cannot resume from {path}: {key} was {value!r} there, the run has {identity.get(key)!r} "
                "(the data order would change mid-run; use a new run_dir or the checkpoint's settings)"
            )


def train(cfg: SFTConfig) -> dict[str, Any]:
    """Run SFT as configured (single process or one torchrun rank); returns the final summary."""
    with distributed(cfg.model.device) as world:
        return _train(cfg, world)


def _train(cfg: SFTConfig, world: World) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    ckpt_root = cfg.run_dir / CHECKPOINTS
    resume_from = checkpoint_to_resume(ckpt_root, cfg.resume, world, "sft")
    prepare_model_source(cfg, world)
    tokenizer = load_tokenizer(cfg.model.name)
    dataset = build_dataset(cfg.data, tokenizer, cfg.seed, cfg.seq_len)
    identity = data_identity(cfg, dataset)
    if world.is_main and cfg.data.task == "chat_jsonl":
        final = "; no held-out evaluation (chat_jsonl has no held-out split)" if cfg.eval.final else ""
        print(f"sft: {len(dataset)} chats from {cfg.data.path}{final}", flush=True)
    if resume_from:
        check_resume_data(resume_from, identity)

    state = build_training_state(cfg, world, resume_from)
    model, optimizer, scheduler, step = state.model, state.optimizer, state.scheduler, state.step
    position = int(state.extra["data_position"]) if resume_from else 0
    if resume_from and world.is_main:
        print(f"sft: resumed from {resume_from} (step {step})", flush=True)

    def checkpoint(step: int, position: int) -> None:
        extra = {"data_position": position, "data": identity}
        save_checkpoint(ckpt_root, step, model, optimizer, scheduler, world, extra, cfg.ckpt.keep)

    can_eval = cfg.data.task == "reverse_text"

    def evaluate(step: int) -> dict[str, float]:
        result = evaluate_held_out(model, optimizer, tokenizer, cfg.eval, cfg.seed, cfg.run_dir, world)
        metrics.log(step, **result)
        if world.is_main:
            print(
                f"sft: step {step} held-out reward {result['eval/reward']:.4f}, "
                f"exact match {result['eval/exact_match']:.4f} ({result['eval/seconds']:.1f}s)",
                flush=True,
            )
        return result

    passes = 2 if cfg.parallel.recomputes else 1
    metrics = MetricsWriter(cfg.run_dir / "metrics.jsonl", "sft", enabled=world.is_main)
    progress = TrainingProgress(cfg.max_steps, step, cfg.log.interval, enabled=world.is_main)
    start, total_tokens, start_step, stats = time.monotonic(), 0, step, {}
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    with metrics, progress:
        while step < cfg.max_steps:
            step_start = time.monotonic()
            stats = train_step(model, optimizer, dataset, position, cfg, world)
            stats.update(expert_load(model, passes))
            scheduler.step()
            step += 1
            position += cfg.data.batch_size
            total_tokens += stats["tokens"]
            stats["tokens_per_s"] = stats["tokens"] / (time.monotonic() - step_start)
            stats["elapsed"] = time.monotonic() - start
            stats.update(_memory(world))
            metrics.log(step, **stats)
            progress.update(step, {k: stats[k] for k in ("loss", "grad_norm", "tokens_per_s")})
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                checkpoint(step, position)
            if can_eval and cfg.eval.interval and step % cfg.eval.interval == 0 and step < cfg.max_steps:
                evaluate(step)
        final_eval = evaluate(step) if can_eval and cfg.eval.final and step > start_step else {}
    if cfg.ckpt.final and step > start_step and not (cfg.ckpt.interval and step % cfg.ckpt.interval == 0):
        checkpoint(step, position)
    final_dir = cfg.run_dir / "final"
    write_hf_model(model, tokenizer, final_dir, world, optimizer=optimizer)
    if lora_enabled(cfg.lora):
        write_hf_model(model, tokenizer, cfg.run_dir / "final-merged", world, merged=True)
    elapsed = time.monotonic() - start
    summary = {
        "steps": step,
        "loss": stats.get("loss"),
        "tokens_per_s": total_tokens / elapsed if elapsed > 0 else 0.0,
        "train_seconds": elapsed,
        "final_model": str(final_dir),
        **final_eval,
        **_memory(world),
    }
    if world.is_main:
        memory = f", peak memory {summary['peak_memory_gib']:.2f} GiB" if "peak_memory_gib" in summary else ""
        loss = f"{summary['loss']:.4f}" if summary["loss"] is not None else "n/a"
        print(
            f"sft: done {step} steps in {elapsed:.1f}s, loss {loss}, {summary['tokens_per_s']:,.0f} tokens/s "
            f"({world.size} rank{'s' if world.size > 1 else ''}){memory}; model in {final_dir}",
            flush=True,
        )
    return summary


def _memory(world: World) -> dict[str, float]:
    if world.device.type != "cuda":
        return {}
    return {"peak_memory_gib": torch.cuda.max_memory_allocated(world.device) / 2**30}
