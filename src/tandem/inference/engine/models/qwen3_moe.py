"""Qwen3-MoE: Qwen3's layers with a mixture of experts as the MLP of its sparse layers.

The router and the experts are the trainer's (`tandem.models.layers.moe`: a softmax router in
fp32, top-k, renormalised when `norm_topk_prob`; experts stacked [experts, out, in] and run as
one grouped GEMM on CUDA in bf16, a loop over experts elsewhere), and the block combines their
outputs as the trainer's does, so the sampler and the trainer compute the same numbers. Two
differences, neither numeric: tokens per expert are counted with a scatter-add instead of
`bincount` (which reads its input's maximum back to the host), so a decode step stays
capturable in a CUDA graph; and no load statistics are kept.

Checkpoints name every expert's weights (`mlp.experts.{e}.gate_proj.weight`, `up_proj`,
`down_proj`); here those are views into the stacked weights, so a weight update fills them.
transformers holds them stacked in memory (`mlp.experts.gate_up_proj`, `down_proj`), which
`from_transformers` splits back into the checkpoint's names.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.models.layers import CausalLM, GatedMLP
from tandem.models.layers.moe import GroupedExperts, Router
from tandem.models.qwen3_moe.model import is_sparse, router_spec


class _Weight(nn.Module):
    """Holds one expert projection's weight under its checkpoint name."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class _Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _Weight(intermediate, hidden)
        self.up_proj = _Weight(intermediate, hidden)
        self.down_proj = _Weight(hidden, intermediate)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden = config.hidden_size
        self.intermediate = config.moe_intermediate_size
        self.gate = Router(self.hidden, router_spec(config))
        self.experts = nn.ModuleList(_Expert(self.hidden, self.intermediate) for _ in range(self.num_experts))
        self.__dict__["grouped"] = None  # the trainer's GroupedExperts over the stacked weights (fuse)

    def fuse(self) -> None:
        """Stack the experts' weights; each expert's checkpoint-named weight becomes a view."""
        gate_up = torch.stack(
            [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts]
        ).detach()
        down = torch.stack([e.down_proj.weight for e in self.experts]).detach()
        size = self.intermediate
        for i, expert in enumerate(self.experts):
            expert.gate_proj.weight = nn.Parameter(gate_up[i, :size], requires_grad=False)
            expert.up_proj.weight = nn.Parameter(gate_up[i, size:], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        with torch.device("meta"):
            grouped = GroupedExperts(self.num_experts, self.hidden, size)
        grouped.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
        grouped.w_down = nn.Parameter(down, requires_grad=False)
        self.__dict__["grouped"] = grouped  # (not a submodule: its tensors are the experts' above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)
        flat = indices.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        order = flat.argsort(stable=True)
        token = order // indices.shape[1]
        y = self.grouped.compute(x[token], counts) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


class Qwen3MoeForCausalLM(CausalLM):
    def mlp(self, config: PretrainedConfig, index: int) -> nn.Module:
        if is_sparse(config, index):
            return SparseMoeBlock(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def graph_safe(self, dtype: torch.dtype) -> bool:
        """The grouped GEMM (CUDA, bf16) needs no host sync; the loop over experts does."""
        return dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    @classmethod
    def from_transformers(
        cls, state_dict: dict[str, torch.Tensor], config: PretrainedConfig
    ) -> dict[str, torch.Tensor]:
        out = {}
        size = config.moe_intermediate_size
        for name, tensor in state_dict.items():
            prefix, _, last = name.rpartition(".")
            if prefix.endswith(".mlp.experts") and last == "gate_up_proj":  # [E, 2I, H]
                for e in range(tensor.shape[0]):
                    out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :size]
                    out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, size:]
            elif prefix.endswith(".mlp.experts") and last == "down_proj":  # [E, H, I]
                for e in range(tensor.shape[0]):
                    out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
            else:
                out[name] = tensor
        return out
