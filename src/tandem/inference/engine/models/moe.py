"""The engine's mixture-of-experts block, shared by its MoE families (Qwen3-MoE, GLM-4.5, MiniMax-M2,
GLM-5).

The router and the experts are the trainer's (`tandem.models.layers.moe`: a softmax or sigmoid
router in fp32 with the optional correction bias and expert groups; experts stacked [experts,
out, in] and run as one grouped GEMM on CUDA in bf16, a loop over experts elsewhere), and the
block routes tokens to them and combines their outputs through the trainer's
`dispatch_and_combine`, so the sampler and the trainer compute the same numbers. Two differences, neither numeric: tokens per expert are counted with a
scatter-add instead of `bincount` (which reads its input's maximum back to the host), so a
decode step stays capturable in a CUDA graph; and no load statistics are kept.

Checkpoints name every expert's weights (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`,
or Mixtral's `w1`, `w3`, `w2`); here those are views into the stacked weights, so a weight
update fills them. transformers holds them stacked in memory (`experts.gate_up_proj`,
`down_proj`), which `split_experts` turns back into the checkpoint's names.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.models.layers import CausalLM, GatedMLP
from tandem.models.layers.moe import GroupedExperts, Router, RouterSpec, dispatch_and_combine

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # the checkpoint's gate, up and down


class _Weight(nn.Module):
    """Holds one expert projection's weight under its checkpoint name."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class _Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        setattr(self, gate, _Weight(intermediate, hidden))
        setattr(self, up, _Weight(intermediate, hidden))
        setattr(self, down, _Weight(hidden, intermediate))


class SparseMoeBlock(nn.Module):
    """Router `gate`, experts `experts.{e}`, optional `shared_experts` (always on, unweighted) and,
    with `bias_beside_gate`, the router's correction bias `e_score_correction_bias` in the block
    rather than in the router (MiniMax-M2's layout)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        spec: RouterSpec,
        names: tuple[str, str, str] = EXPERT_NAMES,
        shared_intermediate: int = 0,
        bias_beside_gate: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.names = (
            spec.num_experts,
            hidden,
            intermediate,
            names,
        )
        if bias_beside_gate:
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts))
            spec = RouterSpec(**{**spec.__dict__, "correction_bias": False})
        else:
            self.e_score_correction_bias = None
        self.gate = Router(hidden, spec)
        self.experts = nn.ModuleList(_Expert(hidden, intermediate, names) for _ in range(self.num_experts))
        self.shared_experts = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.__dict__["grouped"] = None  # the trainer's GroupedExperts over the stacked weights (fuse)

    def fuse(self) -> None:
        """Stack the experts' weights; each expert's checkpoint-named weight becomes a view."""
        gate, up, down = self.names
        weights = [[getattr(e, name).weight for name in self.names] for e in self.experts]
        gate_up = torch.stack([torch.cat([g, u]) for g, u, _ in weights]).detach()
        stacked_down = torch.stack([d for _, _, d in weights]).detach()
        size = self.intermediate
        for i, expert in enumerate(self.experts):
            getattr(expert, gate).weight = nn.Parameter(gate_up[i, :size], requires_grad=False)
            getattr(expert, up).weight = nn.Parameter(gate_up[i, size:], requires_grad=False)
            getattr(expert, down).weight = nn.Parameter(stacked_down[i], requires_grad=False)
        with torch.device("meta"):
            grouped = GroupedExperts(self.num_experts, self.hidden, size)
        grouped.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
        grouped.w_down = nn.Parameter(stacked_down, requires_grad=False)
        self.__dict__["grouped"] = grouped  # (not a submodule: its tensors are the experts' above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, self.e_score_correction_bias)
        flat = indices.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        out = dispatch_and_combine(x, weights, indices, counts, self.grouped.compute)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def split_experts(
    state_dict: dict[str, torch.Tensor],
    intermediate: int,
    names: tuple[str, str, str] = EXPERT_NAMES,
    rename: tuple[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """A transformers model's tensors under checkpoint names: stacked `experts.gate_up_proj`
    [E, 2I, H] and `experts.down_proj` [E, H, I] split per expert (as views) under `names`, and
    `rename` = (old, new) applied to every name (MiniMax-M2's `.mlp.` → `.block_sparse_moe.`)."""
    gate, up, down = names
    out = {}
    for name, tensor in state_dict.items():
        if rename is not None:
            name = name.replace(*rename)
        prefix, _, last = name.rpartition(".")
        if prefix.endswith(".experts") and last == "gate_up_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.{gate}.weight"] = tensor[e, :intermediate]
                out[f"{prefix}.{e}.{up}.weight"] = tensor[e, intermediate:]
        elif prefix.endswith(".experts") and last == "down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.{down}.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


class MoeCausalLM(CausalLM):
    """What the engine's MoE families share: decode steps capturable where the experts run as one
    grouped GEMM, and transformers' stacked experts split into the checkpoint's names."""

    expert_names = ("gate_proj", "up_proj", "down_proj")
    rename: tuple[str, str] | None = None  # (transformers' in-memory name part, the checkpoint's)

    def graph_safe(self, dtype: torch.dtype) -> bool:
        """The grouped GEMM (CUDA, bf16) needs no host sync; the loop over experts does."""
        return dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    @classmethod
    def expert_size(cls, config: PretrainedConfig) -> int:
        return config.moe_intermediate_size

    @classmethod
    def from_transformers(
        cls, state_dict: dict[str, torch.Tensor], config: PretrainedConfig
    ) -> dict[str, torch.Tensor]:
        return split_experts(state_dict, cls.expert_size(config), cls.expert_names, cls.rename)
