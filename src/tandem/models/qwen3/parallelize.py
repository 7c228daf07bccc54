"""Qwen3 dense: activation checkpointing, compile per block, FSDP2 (no experts to split)."""

from tandem.models.layers.transformer import CausalLM
from tandem.models.parallelism import ParallelPlan, parallelize_decoder


def parallelize(model: CausalLM, plan: ParallelPlan) -> None:
    if plan.ep > 1:
        raise ValueError("trainer.parallel.ep > 1 needs a mixture-of-experts model; qwen3 is dense")
    parallelize_decoder(model, plan)
