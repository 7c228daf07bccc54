"""One rank of the expert-parallelism equivalence test (run under torchrun, gloo on CPU).

    python -m torch.distributed.run --nproc-per-node N ep_worker.py MODEL OUT EP [MASTER_WEIGHTS [CHECKPOINTING]]

Trains a tiny Qwen3-MoE for STEPS steps on a fixed global batch of packed documents, each
rank taking its round-robin share of the rows, the loss normalised by the global token count
as the trainers do. Rank 0 writes the losses, the full gradients of the last step (in
checkpoint names) and the final weights to OUT (torch.save). MASTER_WEIGHTS is
optim.master_weights ("model" unless given), CHECKPOINTING parallel.activation_checkpointing
("none" unless given).
"""

import sys

import torch

from tandem.config.base import ModelConfig
from tandem.trainer.config import OptimConfig, ParallelConfig
from tandem.trainer.model import build_trainer_model
from tandem.trainer.optim import build_optimizer, clip_grad_norm, gradient
from tandem.trainer.parallel import all_reduce_sum, end_process, init_distributed, shutdown
from tandem.trainer.weight_stream import iter_hf_weights

STEPS, ROWS, WIDTH = 3, 8, 48


def global_batch(vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (ROWS, WIDTH), generator=generator)
    positions = torch.cat([torch.arange(n) for n in (20, 5, 23)]).repeat(ROWS, 1)
    return ids, positions


def main() -> None:
    model_dir, out, ep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    master_weights = sys.argv[4] if len(sys.argv) > 4 else "model"
    checkpointing = sys.argv[5] if len(sys.argv) > 5 else "none"
    torch.set_num_threads(1)
    world = init_distributed("cpu")
    model = build_trainer_model(
        ModelConfig(name=model_dir, device="cpu"),
        world,
        ParallelConfig(ep=ep, activation_checkpointing=checkpointing),
        master_weights=master_weights,
    )
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, master_weights=master_weights))
    losses, grads = [], {}
    for step in range(STEPS):
        ids, positions = global_batch(model.hf_config.vocab_size, step)
        mine = slice(world.rank, None, world.size)
        logprobs, _ = model.sequence_logprobs(ids[mine], positions[mine])
        tokens = ROWS * (WIDTH - 1)
        partial = -logprobs.sum()
        (partial * world.size / tokens).backward()
        if step == STEPS - 1:
            grads = {
                name: g.clone() for name, g in iter_hf_weights(model, of=lambda t: gradient(optimizer, t))
            }
        clip_grad_norm(optimizer, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(all_reduce_sum(partial.detach())) / tokens)
    weights = {name: t.clone() for name, t in iter_hf_weights(model)}
    if world.is_main:
        torch.save({"losses": losses, "grads": grads, "weights": weights}, out)
    shutdown(completed=True)  # every rank done (rank 0 saved) before any tears its gloo group down
    end_process()


if __name__ == "__main__":
    main()
