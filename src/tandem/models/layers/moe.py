"""Mixture of experts: a token-choice top-k router in fp32 and experts run as one grouped GEMM.

Routing, per token x:  logits = x·Wᵀ (fp32),  s = softmax(logits) or sigmoid(logits);
the top-k experts are chosen by s + b (b: the optional score-correction bias of aux-loss-free
balancing, a buffer the optimizer never touches, float32 whatever the model's dtype) and
weighted by s itself, renormalised to sum
to 1 if the config says so, times `routed_scaling`. With expert groups (DeepSeek-style grouped
routing: `groups` > 1) the experts are split into equal groups, each group is scored by the sum
of its two best s + b, and the top-k is taken only among the experts of the `top_groups` best
groups. Each chosen expert computes
down(silu(gate(x)) * up(x)); the block returns Σ weight · expert(x), plus shared experts (always
on, unweighted) where the family has them.

Expert weights are stored stacked, [experts, out, in], so the token-expert pairs can be sorted by
expert and run through `torch._grouped_mm` in one launch on CUDA; elsewhere (CPU, fp32) a loop
over experts computes the same thing exactly. Expert parallelism needs no change here:
`parallelize` shards the stacked weights over the `ep` mesh dimension and installs a `dispatcher`
that moves each token to the rank holding its expert and back (models/expert_parallel.py).

Tokens reach their experts and come back through row permutations (`dispatch_and_combine`):
the token-expert pairs sorted by expert, each output put back in its pair's place and weighted
over the k slots of its token. Both directions' backwards are gathers by the inverse
permutation, not the accumulating scatters (atomics) that autograd makes of `x[token]` and
`index_add_`, and the k outputs of a token are summed in fp32.

`tokens_per_expert` accumulates how many token-expert pairs each expert received (on this rank)
since the trainer last read and reset it; the trainer logs the load from it every step.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tandem.models.layers.mlp import MLP


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    score: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    routed_scaling: float = 1.0
    correction_bias: bool = False
    groups: int = 1
    top_groups: int = 1
    # the router's weight stays float32 in a model cast to bf16, where transformers keeps it so
    # (`_keep_in_fp32_modules_strict`: GLM-4.5, GLM-5); the correction bias always does
    fp32_weight: bool = False

    def __post_init__(self) -> None:
        if self.num_experts % self.groups or not 1 <= self.top_groups <= self.groups:
            raise ValueError(
                f"{self.num_experts} experts in {self.groups} groups, {self.top_groups} chosen: "
                "the groups must divide the experts and at most all groups can be chosen"
            )


class Router(nn.Module):
    def __init__(self, dim: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, dim))
        if spec.correction_bias:  # (named as checkpoints name it: the engine's names are theirs)
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts))
        else:
            self.e_score_correction_bias = None

    def keep_fp32(self) -> None:
        """Back to float32 after the model was cast: the correction bias, and the weight where the
        spec says (`fp32_weight`). Routing then reads the checkpoint's fp32 values unrounded, and
        exports write them as they were (the block's FSDP unit leaves such a router to a unit of
        its own: models/parallelism.py `own_dtype_units`)."""
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        if self.spec.fp32_weight:
            self.weight.data = self.weight.data.float()

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.e_score_correction_bias is not None:
            nn.init.zeros_(self.e_score_correction_bias)

    def forward(
        self, x: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] → (weights [T, k] fp32, expert indices [T, k]); `correction_bias` stands in
        for the router's own (where a checkpoint keeps it outside the router, as MiniMax-M2's)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.spec.score == "softmax" else logits.sigmoid()
        bias = self.e_score_correction_bias if correction_bias is None else correction_bias
        choice = scores if bias is None else scores + bias.float()
        if self.spec.groups > 1:
            choice = self._in_best_groups(choice)
        indices = choice.topk(self.spec.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.spec.renormalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return weights * self.spec.routed_scaling, indices

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's `top_groups` best groups set to -inf."""
        grouped = choice.view(choice.shape[0], self.spec.groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(self.spec.top_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


Dispatcher = Callable[[torch.Tensor, torch.Tensor, Callable], torch.Tensor]
"""(tokens sorted by global expert, counts per global expert, local compute) → expert outputs."""


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))  # [gate; up] rows
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.dispatcher: Dispatcher | None = None  # set by expert parallelism

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.w_gate_up, std=std)
        nn.init.normal_(self.w_down, std=std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by expert, counts [num_experts] → [N, dim] (each row by its expert)."""
        if self.dispatcher is not None:
            return self.dispatcher(x, counts, self.compute)
        return self.compute(x, counts)

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on their tokens (under EP: the tokens sent to this rank)."""
        w_gate_up, w_down = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w_gate_up, self.w_down)
        )
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(x, w_gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offsets)
        outs = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            gate, up = (chunk @ w_gate_up[e].T).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w_down[e].T)
        return torch.cat(outs) if outs else x


class _GatherPairs(torch.autograd.Function):
    """x [T, dim] → x[token] [T·k, dim], the token of each pair in expert order; the backward sums
    each token's k pair gradients, found through the inverse permutation."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.tokens = x.shape[0]
        return x[token]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        (inverse,) = ctx.saved_tensors
        return grad[inverse].view(ctx.tokens, -1, grad.shape[1]).sum(1), None, None


class _PermuteRows(torch.autograd.Function):
    """y[index] for a permutation `index` whose inverse is `inverse`: the backward is y's gradient
    gathered by `inverse`."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return y[index]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def dispatch_and_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Σ_slots weight · expert(x) per token: x [T, dim], the router's weights and expert indices
    [T, k], counts [num_experts] of the pairs per expert; `experts` maps the pairs' inputs sorted
    by expert (and the counts) to their outputs. The trainer's layer and the engine's block both
    route through here, so they compute the same numbers."""
    k = indices.shape[1]
    order = indices.flatten().argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    y = experts(_GatherPairs.apply(x, order // k, inverse), counts)
    y = _PermuteRows.apply(y, inverse, order).view(-1, k, x.shape[-1])
    return (y * weights[..., None]).sum(1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, spec: RouterSpec, shared_hidden_dim: int = 0) -> None:
        super().__init__()
        self.router = Router(dim, spec)
        self.experts = GroupedExperts(spec.num_experts, dim, hidden_dim)
        self.shared = MLP(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.router(x)
        counts = torch.bincount(indices.flatten(), minlength=self.experts.num_experts)
        with torch.no_grad():
            self.tokens_per_expert += counts
        out = dispatch_and_combine(x, weights, indices, counts, self.experts)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    def reset_buffers(self) -> None:
        self.tokens_per_expert.zero_()
