"""Per-step expert load of mixture-of-experts models, for metrics.jsonl.

Every MoE layer counts the token-expert pairs routed to each expert (models/layers/moe.py);
after each optimizer step the trainer sums the counts over ranks, turns them into

    moe/tokens_per_expert      mean token-expert pairs per expert and layer in the step
    moe/max_over_mean          the busiest expert's load over the mean, in the worst layer (1 = balanced)
    moe/mean_max_over_mean     the same ratio averaged over layers
    moe/unused_experts         fraction of (layer, expert) pairs that received no token

and resets the counters. With full activation checkpointing every forward runs twice; the
counts are divided by the passes so they stay per token.
"""

import torch
from torch import nn

from tandem.models.layers.moe import MoE
from tandem.trainer.parallel import all_reduce_sum


def expert_load(model: nn.Module, passes: int = 1) -> dict[str, float]:
    """The metrics above, reset for the next step; {} for a model without MoE layers (collective)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return {}
    counts = torch.stack([m.tokens_per_expert for m in layers]).double()
    counts = all_reduce_sum(counts) / passes
    for m in layers:
        m.tokens_per_expert.zero_()
    mean = counts.mean(dim=1).clamp_min(1e-9)
    ratio = counts.max(dim=1).values / mean
    return {
        "moe/tokens_per_expert": float(counts.mean()),
        "moe/max_over_mean": float(ratio.max()),
        "moe/mean_max_over_mean": float(ratio.mean()),
        "moe/unused_experts": float((counts == 0).double().mean()),
    }
