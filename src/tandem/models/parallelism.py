"""How a tandem model is parallelised for training: FSDP2, context parallelism, activation
checkpointing and offload, compile.

The ranks are laid out twice, ep and cp innermost, so each expert-parallel and each
context-parallel group is a run of consecutive ranks: `mesh` is (efsdp, ep), `cp_mesh` is
(dp, cp) over the same ranks. Dense parameters are FSDP-sharded over all ranks (dp × cp, the
mesh flattened to `dp`); expert weights are split over `ep` (each rank holds num_experts / ep
experts) and FSDP-sharded over `efsdp` along their second dimension (so the two shardings never
split the same dim). The ranks of a cp group share a micro-batch, each holding its columns of
the rows (models/context_parallel.py); the ranks of a dp group read different micro-batches.

Gradients: the trainers scale each rank's loss (over its own tokens, divided by the step's
global token count) by world size and FSDP averages over the ranks it reduces over. Expert
gradients already sum the contributions of the whole ep group (they come back through the
all-to-all), so their FSDP groups divide by the world size, not by the efsdp size: every
parameter ends with the gradient of the global loss, with or without CP.

Order (each a function of this module, applied by a family's parallelize.py): expert
parallelism, then context parallelism, activation checkpointing or offload and torch.compile
per block, then FSDP per block and at the root (not where `plan.fsdp` is off: one rank whose
parameters need no cast). None of them renames a parameter, so checkpoints and adapters see the
same names with and without them, and a checkpoint of a model without FSDP loads into one with it
(torch.distributed.checkpoint reshards).
"""

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tandem.config.base import CPStyle
from tandem.models.activation_offload import ActivationOffloader, offloaded_forward
from tandem.models.context_parallel import apply_context_parallel
from tandem.models.layers.moe import MoE
from tandem.models.layers.transformer import CausalLM

ActivationCheckpointing = Literal["none", "full", "selective"]


@dataclass
class ParallelPlan:
    mesh: DeviceMesh  # ("efsdp", "ep")
    mp_policy: MixedPrecisionPolicy
    activation_checkpointing: ActivationCheckpointing = "none"
    compile: bool = False
    # FSDP's default; False keeps each block's gathered weights from forward to backward, and
    # then they must be dropped whenever the shards change (drop_gathered_weights)
    reshard_after_forward: bool = True
    cp_mesh: DeviceMesh | None = None  # ("dp", "cp") over the same ranks; None: no context parallelism
    cp_style: CPStyle = "ulysses"
    activation_offload: bool = False
    # False: the model stays a plain module (one rank whose parameters are already in the compute
    # dtype: FSDP would only copy every weight into its gather buffer and every gradient out of
    # its scatter buffer, ~20 ms a step for 5 B parameters on the H200)
    fsdp: bool = True

    @property
    def ep(self) -> int:
        return self.mesh["ep"].size()

    @property
    def cp(self) -> int:
        return 1 if self.cp_mesh is None else self.cp_mesh["cp"].size()

    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["efsdp", "ep"]._flatten("dp")


@functools.cache
def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps. The attention backends that are custom
    operators (varlen's `torch_attn::_varlen_attn`, cudnn's `cudnn::sdpa_fwd`, flash's
    `tandem::flash_varlen_fwd`) are opaque to SAC, which sees them and not the kernels inside: they
    are listed by their own names (cudnn's only once its package registered it, which
    resolve_backend does before any forward)."""
    aten = torch.ops.aten
    names = (
        "mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm", "_flash_attention_forward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )  # fmt: skip
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    with contextlib.suppress(ImportError):
        importlib.import_module("torch.nn.attention.varlen")  # registers torch_attn::_varlen_attn
    custom = (("torch_attn", "_varlen_attn"), ("cudnn", "sdpa_fwd"), ("tandem", "flash_varlen_fwd"))
    for namespace, name in custom:
        with contextlib.suppress(AttributeError):
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
    return frozenset(ops | {torch.ops.higher_order.flex_attention})


def _profiler_ranges_outside_selective_checkpointing() -> None:
    """Selective checkpointing (torch 2.14 here) replays a block's recomputation op by op against
    the forward's invocation counts, every op included. FSDP2's hooks around a unit nested in the
    block (the experts' own unit under ep > 1) open profiler ranges a different number of times
    in the recomputation, which then fails ("profiler._record_function_enter_new ... not found in
    storage"). Those ranges are annotations, not tensor work: they join the ops SAC ignores (as
    metadata queries are), which is also what a proposed upstream fix does (pytorch#196862)."""
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None)
    if ignored is not None:
        profiler = torch.ops.profiler
        ignored |= {
            profiler._record_function_enter.default,
            profiler._record_function_enter_new.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        }


def _keep_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Selective AC: keep what the matmuls and attention kernels computed, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: CausalLM, mode: ActivationCheckpointing) -> None:
    """Recompute each block's activations in backward, keeping parameter names as they are: all of
    them (full: a block keeps only its input), or all but the matmul and attention outputs
    (selective: the norms, activations, RoPE and other elementwise work are recomputed)."""
    if mode == "selective":
        _profiler_ranges_outside_selective_checkpointing()
    context = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)}
    for layer in model.layers:
        forward = layer.forward

        def checkpointed(*args: object, _forward=forward) -> torch.Tensor:
            return checkpoint(
                _forward, *args, use_reentrant=False, **(context if mode == "selective" else {})
            )

        layer.forward = checkpointed


def apply_activation_offload(model: CausalLM, compile: bool) -> None:
    """Offload each block's saved activations to host memory (models/activation_offload.py):
    all of them, or after apply_activation_checkpointing("full") only each block's input (what
    the checkpoint saves through autograd). With `compile`, the block's forward is compiled
    inside the offload hooks (in place of apply_compile, which would compile the hooks too)."""
    offloader = ActivationOffloader()
    for layer in model.layers:
        forward = torch.compile(layer.forward) if compile else layer.forward
        layer.forward = offloaded_forward(forward, offloader)


def apply_compile(model: CausalLM) -> None:
    """torch.compile each block in place (its __call__; parameter names are unchanged)."""
    for layer in model.layers:
        layer.compile()


def apply_fsdp(model: CausalLM, plan: ParallelPlan) -> None:
    world = plan.mesh.size()
    if not plan.fsdp:
        if world > 1 or plan.mp_policy.param_dtype is not None:
            raise ValueError("a model without FSDP must run on one rank with no casts")
        model.keeps_gathered_weights = False
        return
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
        for unit in own_dtype_units(layer):
            fully_shard(
                unit, mesh=plan.dp_mesh, mp_policy=OWN_DTYPE, reshard_after_forward=plan.reshard_after_forward
            )
        fully_shard(
            layer,
            mesh=plan.dp_mesh,
            mp_policy=plan.mp_policy,
            reshard_after_forward=plan.reshard_after_forward,
        )
    fully_shard(
        model, mesh=plan.dp_mesh, mp_policy=plan.mp_policy, reshard_after_forward=plan.reshard_after_forward
    )
    model.keeps_gathered_weights = not plan.reshard_after_forward


OWN_DTYPE = MixedPrecisionPolicy()
"""The policy of an `own_dtype_units` unit: its parameters gathered, computed with and reduced in
their own dtype (an fp32 router computes in fp32 anyway)."""


def own_dtype_units(block: nn.Module) -> list[nn.Module]:
    """The submodules of `block` whose own parameters are all of one dtype other than the block's
    (that of most of its parameter elements): a router kept in float32 in a bf16 model, tandem's
    (Router.keep_fp32) or transformers' (`_keep_in_fp32_modules_strict`). FSDP2 needs one dtype
    among a unit's trainable parameters ("FSDP expects uniform original parameter dtype"), so each
    becomes a unit of its own before the block's: one more (small) all-gather and reduce-scatter
    per such router. A LoRA layer's fp32 adapters share their module with its base weight, and
    stay in the block's unit, cast as before."""
    sizes: dict[torch.dtype, int] = {}
    for param in block.parameters():
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    if len(sizes) < 2:
        return []
    dtype = max(sizes, key=sizes.get)
    units = []
    for module in block.modules():
        own = {p.dtype for p in module.parameters(recurse=False)}
        if module is not block and not isinstance(module, FSDPModule) and len(own) == 1 and dtype not in own:
            units.append(module)
    return units


def drop_gathered_weights(model: nn.Module) -> None:
    """Free every FSDP unit's gathered weights, so the next forward gathers the current shards.
    With reshard_after_forward off, a forward that no backward follows (under no_grad, or one
    whose graph is dropped) leaves them gathered, and they would outlive an optimizer step:
    build_optimizer calls this after every step of such a model. Gathered weights are also what
    `model.parameters()` then returns (FSDP registers them in the shards' place), so
    build_optimizer calls it first too: an optimizer built over them updated copies that the
    next gather replaced, and the weights stood still (H200, torch 2.11; CPU, torch 2.14)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def parallelize_decoder(model: CausalLM, plan: ParallelPlan) -> None:
    """Everything but expert parallelism, in order; a family's parallelize.py calls it."""
    if plan.cp > 1:
        apply_context_parallel(model, plan.cp_mesh["cp"].get_group(), plan.cp_style)
    if plan.activation_checkpointing != "none":
        apply_activation_checkpointing(model, plan.activation_checkpointing)
    if plan.activation_offload:
        apply_activation_offload(model, plan.compile)
    elif plan.compile:
        apply_compile(model)
    apply_fsdp(model, plan)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
