"""Expert parallelism: experts split over the `ep` ranks, tokens moved to them by all-to-all.

Each of the P ranks of an ep group holds L = E / P consecutive experts (its slice of the
stacked expert weights, a DTensor sharded on dim 0 over the ep mesh). A MoE layer hands its
dispatcher the token copies sorted by global expert and the count per expert; the dispatcher

1. exchanges the counts (all-to-all of [P, L] blocks), so every rank knows how many tokens each
   source sends to each of its experts;
2. sends every token copy to the rank of its expert (all-to-all with uneven splits); received
   tokens arrive grouped by source, and are reordered to be grouped by local expert;
3. runs the local experts, restores the source order and sends the results back.

Both all-to-alls are differentiable (the backward of one is the all-to-all with the splits
swapped), so expert gradients collect every rank's tokens. Works on NCCL and gloo, which has
all_to_all_single with uneven splits.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tandem.models.layers.moe import MoE


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def expert_major_order(counts: torch.Tensor) -> torch.Tensor:
    """counts [P, L]: token blocks laid out source-major (s0e0, s0e1, …); the permutation that
    regroups them expert-major (e0s0, e0s1, …), keeping each block's internal order."""
    sources, experts = counts.shape
    block = torch.arange(sources * experts, device=counts.device)
    block_key = (block % experts) * sources + block // experts
    return torch.repeat_interleave(block_key, counts.flatten()).argsort(stable=True)


class AllToAllDispatcher:
    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.local = num_experts // self.size

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:  # noqa: ANN001
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, self.local)
        send_splits = counts.view(self.size, self.local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        tokens = all_to_all(x, recv_splits, send_splits, self.group)
        order = expert_major_order(received)
        out = compute(tokens[order], received.sum(0))
        return all_to_all(out[order.argsort()], send_splits, recv_splits, self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts over `ep_mesh` and route its tokens by all-to-all."""
    size = ep_mesh.size()
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        experts = moe.experts
        if experts.num_experts % size:
            raise ValueError(
                f"trainer.parallel.ep = {size} does not divide the {experts.num_experts} experts"
            )
        for name in ("w_gate_up", "w_down"):
            full = getattr(experts, name)
            local = full.new_empty((full.shape[0] // size, *full.shape[1:]))
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded))
        experts.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), experts.num_experts)
