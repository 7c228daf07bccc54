"""Qwen3-MoE: expert parallelism over the ep mesh dimension, then what Qwen3 dense gets."""

from tandem.models.expert_parallel import apply_expert_parallel
from tandem.models.layers.transformer import CausalLM
from tandem.models.parallelism import ParallelPlan, parallelize_decoder


def parallelize(model: CausalLM, plan: ParallelPlan) -> None:
    if plan.ep > 1:
        apply_expert_parallel(model, plan.mesh["ep"])
    parallelize_decoder(model, plan)
