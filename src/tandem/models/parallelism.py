"""How a tandem model is parallelised for training: FSDP2, activation checkpointing, compile.

The mesh is two-dimensional, (efsdp, ep) with ep innermost, so each expert-parallel group is a
run of consecutive ranks. Dense parameters are FSDP-sharded over all of it (flattened to `dp`);
expert weights are split over `ep` (each rank holds num_experts / ep experts) and FSDP-sharded
over `efsdp` along their second dimension (so the two shardings never split the same dim).

Gradients: the trainers scale each rank's loss by world size and FSDP averages over the ranks
it reduces over. Expert gradients already sum the contributions of the whole ep group (they
come back through the all-to-all), so their FSDP groups divide by the world size, not by the
efsdp size: every parameter ends with the gradient of the global loss.

Order (each a function of this module, applied by a family's parallelize.py): expert
parallelism, then activation checkpointing and torch.compile per block, then FSDP per block
and at the root. None of them renames a parameter, so checkpoints and adapters see the same
names with and without them.
"""

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

from tandem.models.layers.moe import MoE
from tandem.models.layers.transformer import CausalLM

ActivationCheckpointing = Literal["none", "full"]


@dataclass
class ParallelPlan:
    mesh: DeviceMesh  # ("efsdp", "ep")
    mp_policy: MixedPrecisionPolicy
    activation_checkpointing: ActivationCheckpointing = "none"
    compile: bool = False
    reshard_after_forward: bool = True

    @property
    def ep(self) -> int:
        return self.mesh["ep"].size()

    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["efsdp", "ep"]._flatten("dp")


def apply_activation_checkpointing(model: CausalLM) -> None:
    """Recompute each block's activations in backward (full AC), keeping parameter names as they are."""
    for layer in model.layers:
        forward = layer.forward

        def checkpointed(*args: object, _forward=forward) -> torch.Tensor:
            return checkpoint(_forward, *args, use_reentrant=False)

        layer.forward = checkpointed


def apply_compile(model: CausalLM) -> None:
    """torch.compile each block in place (its __call__; parameter names are unchanged)."""
    for layer in model.layers:
        layer.compile()


def apply_fsdp(model: CausalLM, plan: ParallelPlan) -> None:
    world = plan.mesh.size()
    for layer in model.layers:
        if plan.ep > 1 and isinstance(layer.mlp, MoE):
            fully_shard(
                layer.mlp.experts,
                mesh=plan.mesh["efsdp"],
                mp_policy=plan.mp_policy,
                reshard_after_forward=plan.reshard_after_forward,
                shard_placement_fn=lambda _: Shard(1),
            )
            layer.mlp.experts.set_gradient_divide_factor(float(world))
            if plan.mesh.device_type == "cpu" and plan.mesh["efsdp"].size() > 1:
                # gloo has no PREMUL_SUM: sum, then divide (on a group of one, torch 2.14 would
                # then divide twice, so only where there is a reduction to make)
                layer.mlp.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(
            layer,
            mesh=plan.dp_mesh,
            mp_policy=plan.mp_policy,
            reshard_after_forward=plan.reshard_after_forward,
        )
    fully_shard(
        model, mesh=plan.dp_mesh, mp_policy=plan.mp_policy, reshard_after_forward=plan.reshard_after_forward
    )


def parallelize_decoder(model: CausalLM, plan: ParallelPlan) -> None:
    """Everything but expert parallelism, in order; a family's parallelize.py calls it."""
    if plan.activation_checkpointing == "full":
        apply_activation_checkpointing(model)
    if plan.compile:
        apply_compile(model)
    apply_fsdp(model, plan)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
