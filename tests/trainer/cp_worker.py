"""The ranks of the context-parallelism equivalence tests (gloo on CPU).

    python cp_worker.py RANKS DENSE MOE GLM5 OUT

Imports torch and tandem once, then forks RANKS processes that form a gloo group as torchrun's
ranks do (RANK, WORLD_SIZE, MASTER_ADDR/PORT), so the 4-rank test pays for one import of torch
instead of five. Each rank runs every case of CASES in turn on the same global batch: builds the
trainer's model with that case's trainer.parallel settings, runs the SFT or the RL trainer's
micro-batch loss over its data-parallel group's share (the trainers' own functions, normalised
by the global loss-token count, or for GSPO per sample, and scaled by the world size as they do)
and one backward; RL cases then also take the RL trainer's whole step and keep the statistics it
logs. Rank 0
writes, per case, the global loss and the full gradients (in checkpoint names) to OUT
(torch.save); the test compares each case with its cp = 1 case; `shard_width` is how many
columns of each row a rank held.

The packed rows hold documents that cross the boundaries of every cp split used here, and a
width (46) that ring and cp = 4 must pad. GLM-5's indexer keeps 4 keys per query, so its choice
matters, and it and the sparse path run a few queries at a time (chunks that split each rank's
columns at other places than cp does). For GLM-5 the attention entry may also name settings
of `latent_settings` (the model is then built with sdpa): the sparse path, which CPU backends
do not choose, and micro-batches that skip the indexers.
"""

import multiprocessing
import os
import socket
import sys

import torch

from tandem.config.base import ModelConfig, cp_width_multiple
from tandem.models.layers.dsa import Indexer
from tandem.models.layers.mla import LatentAttention
from tandem.trainer.config import ParallelConfig
from tandem.trainer.model import build_trainer_model
from tandem.trainer.optim import build_optimizer
from tandem.trainer.packing import MicroBatch as SFTBatch
from tandem.trainer.parallel import World, all_reduce_sum, data_shard, init_distributed, shutdown
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.loss import build_objective
from tandem.trainer.rl.train import micro_batch_loss, train_step
from tandem.trainer.sft.train import token_loss_sum
from tandem.trainer.weight_stream import iter_hf_weights
from tandem.transport.rollouts import Sample, pack_samples

DOCS = [[13, 7, 20, 6], [30, 16], [5, 5, 36], [46]]  # per row; every row 46 tokens
WIDTH = 46
RL_LENGTHS = [40, 9, 23, 31, 12, 17, 44, 6, 28, 35]
# name: (model, loss, trainer.parallel[, model.attention]); each compared with its cp = 1 case
CASES = {
    "dense": ("dense", "sft", {}),
    "dense-ulysses2": ("dense", "sft", {"cp": 2}),
    "dense-ring2": ("dense", "sft", {"cp": 2, "cp_style": "ring"}),
    "dense-ring2-sdpa_docs": ("dense", "sft", {"cp": 2, "cp_style": "ring"}, "sdpa_docs"),
    "dense-ulysses4": ("dense", "sft", {"cp": 4}),  # 2 KV heads < 4: replicated
    "dense-ring4-selective": (
        "dense",
        "sft",
        {"cp": 4, "cp_style": "ring", "activation_checkpointing": "selective"},
    ),
    "rl": ("dense", "rl", {}),
    "rl-ring2": ("dense", "rl", {"cp": 2, "cp_style": "ring"}),
    "rl-ulysses4": ("dense", "rl", {"cp": 4}),
    "gspo": ("dense", "gspo", {}),  # per-sample ratios: a sample's sums all-reduced over its cp group
    "gspo-ring2": ("dense", "gspo", {"cp": 2, "cp_style": "ring"}),
    "gspo-ulysses4": ("dense", "gspo", {"cp": 4}),
    "moe": ("moe", "sft", {}),
    "moe-ulysses2-ep2-full": ("moe", "sft", {"cp": 2, "ep": 2, "activation_checkpointing": "full"}),
    "moe-ring2-ep2": ("moe", "sft", {"cp": 2, "cp_style": "ring", "ep": 2}),
    "glm5": ("glm5", "sft", {}),
    "glm5-ring2-ep2": ("glm5", "sft", {"cp": 2, "cp_style": "ring", "ep": 2}),
    "glm5-ulysses4-full": ("glm5", "sft", {"cp": 4, "activation_checkpointing": "full"}),
    "glm5sparse": ("glm5", "sft", {}, "sparse"),
    "glm5sparse-ring4": ("glm5", "sft", {"cp": 4, "cp_style": "ring"}, "sparse"),
    "glm5wide": ("glm5", "sft", {}, "wide"),
    "glm5wide-ring2-short": ("glm5", "sft", {"cp": 2, "cp_style": "ring"}, "wide_short"),
    "glm5wide-ulysses4-short": ("glm5", "sft", {"cp": 4}, "wide_short"),
    "glm5rl": ("glm5", "rl", {}),
    "glm5rl-ring2": ("glm5", "rl", {"cp": 2, "cp_style": "ring"}),
}


def sft_batch(vocab: int) -> SFTBatch:
    ids = torch.randint(0, vocab, (len(DOCS), WIDTH), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    return SFTBatch(ids, positions, positions > 2)  # a 3-token "prompt" per document


def rl_samples(vocab: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for i, n in enumerate(RL_LENGTHS):
        prompt = 3 + i % 4
        completion = n - prompt
        samples.append(
            Sample(
                prompt_ids=torch.randint(0, vocab, (prompt,), generator=generator).tolist(),
                completion_ids=torch.randint(0, vocab, (completion,), generator=generator).tolist(),
                completion_mask=[k % 5 != 4 for k in range(completion)],
                # near the tiny model's own (about log 1/512), so few tokens leave the trust region
                completion_logprobs=(-6.2 + 0.3 * torch.randn(completion, generator=generator)).tolist(),
                reward=float(i % 2),
                advantage=float(torch.randn(1, generator=generator)),
                policy_version=0,
            )
        )
    return samples


def sft_loss(model: torch.nn.Module, world_size: int, group: int, groups: int) -> float:
    batch = sft_batch(model.hf_config.vocab_size)
    tokens = int(batch.loss_mask.sum())
    mine = slice(group, None, groups)
    partial = token_loss_sum(model, SFTBatch(*(t[mine] for t in vars(batch).values())))
    (partial * world_size / tokens).backward()
    return float(all_reduce_sum(partial.detach())) / tokens


def rl_micro_batches(model: torch.nn.Module, group: int, groups: int, parallel: ParallelConfig) -> list:
    multiple = cp_width_multiple(parallel.cp, parallel.cp_style)
    per_group = pack_samples(rl_samples(model.hf_config.vocab_size), 48, groups, 96, width_multiple=multiple)
    assert all(mb.input_ids.shape[1] % multiple == 0 for mb in per_group[group])
    return per_group[group]


def rl_config(parallel: ParallelConfig, loss: str) -> RLTrainerConfig:
    """ "rl": the default loss (masked_is, per token); "gspo": GSPO, normalised per sample."""
    return RLTrainerConfig(parallel=parallel, loss={"type": "gspo"} if loss == "gspo" else {})


def rl_loss(
    model: torch.nn.Module, world_size: int, group: int, groups: int, parallel: ParallelConfig, loss: str
) -> float:
    cfg = rl_config(parallel, loss)
    objective = build_objective(cfg.loss)
    total = torch.zeros(())
    for mb in rl_micro_batches(model, group, groups, parallel):
        loss, _ = micro_batch_loss(model, objective, mb, cfg, torch.device("cpu"))
        (loss * world_size).backward()
        total += loss.detach()
    return float(all_reduce_sum(total))


def rl_step_stats(
    model: torch.nn.Module, world: World, group: int, groups: int, parallel: ParallelConfig, loss: str
) -> dict:
    """The RL trainer's whole step (trainer/rl/train.py train_step) and the statistics it logs."""
    cfg = rl_config(parallel, loss)
    optimizer = build_optimizer(model, cfg.optim)
    micro_batches = rl_micro_batches(model, group, groups, parallel)
    stats = train_step(model, build_objective(cfg.loss), optimizer, micro_batches, 0, cfg, world)
    return {
        k: stats[k] for k in ("loss", "loss_tokens", "samples", "tokens", "reward", "mismatch_kl", "entropy")
    }


def latent_settings(model: torch.nn.Module, backend: str) -> None:
    """GLM-5's indexer and sparse attention a few queries at a time; "sparse": the sparse path
    on; "wide": the indexers keep 64 keys (more than any document has); "wide_short": and the
    micro-batches skip them (sparse_attention = "long_documents")."""
    model.dense_short_documents = backend == "wide_short"
    for module in model.modules():
        if isinstance(module, LatentAttention):
            module.sparse = backend == "sparse"
            module.sparse_chunk_elements = 3 * len(DOCS) * 4 * 80  # ~3 queries of 4 keys, L + r <= 80
        if isinstance(module, Indexer):
            module.chunk_elements = 5 * len(DOCS) * module.heads * 48  # ~5 queries of <= 48 keys
            module.topk = 64 if backend.startswith("wide") else module.topk


def run_rank(paths: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    world = init_distributed("cpu")
    results = {}
    for name, (kind, loss, options, *attention) in CASES.items():
        parallel = ParallelConfig(**options)
        backend = (attention or ["auto"])[0]
        attention = "sdpa" if backend in ("sparse", "wide", "wide_short") else backend
        model = build_trainer_model(
            ModelConfig(name=paths[kind], device="cpu", attention=attention), world, parallel
        )
        latent_settings(model, backend)
        group, groups = data_shard(world, parallel.cp)
        if loss == "sft":
            value = sft_loss(model, world.size, group, groups)
        else:
            value = rl_loss(model, world.size, group, groups, parallel, loss)
        grads = {n: g.clone() for n, g in iter_hf_weights(model, of=lambda t: t.grad)}
        cp = model.context_parallel
        shard = WIDTH if cp is None else len(cp.columns(cp.padded_width(WIDTH), torch.device("cpu")))
        results[name] = {"loss": value, "grads": grads, "shard_width": shard}
        if loss != "sft":
            model.zero_grad(set_to_none=True)
            results[name]["stats"] = rl_step_stats(model, world, group, groups, parallel, loss)
    if world.is_main:
        torch.save(results, out)
    shutdown(completed=True)


def forked_rank(rank: int, ranks: int, port: int, paths: dict[str, str], out: str) -> None:
    env = {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "WORLD_SIZE": ranks,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    os.environ.update({k: str(v) for k, v in env.items()})
    run_rank(paths, out)


def main() -> None:
    ranks, out = int(sys.argv[1]), sys.argv[5]
    paths = {"dense": sys.argv[2], "moe": sys.argv[3], "glm5": sys.argv[4]}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=forked_rank, args=(r, ranks, port, paths, out)) for r in range(ranks)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=540)
    failed = [r for r, p in enumerate(processes) if p.exitcode != 0]
    for process in processes:
        if process.is_alive():
            process.kill()
    if failed:
        sys.exit(f"cp_worker: rank(s) {failed} failed or did not finish within 540 s")


if __name__ == "__main__":
    main()
