"""Qwen3-MoE checkpoint names ↔ tandem's: per-expert gate/up/down tensors stacked into
[experts, out, in] weights; the router is `mlp.gate`; the rest is Qwen3's mapping."""

from transformers import PretrainedConfig

from tandem.models.hf_checkpoint import Concat, Layout, Source, Stack
from tandem.models.qwen3.state_dict_adapter import HF_IGNORED, block_layout, dense_mlp_layout, outer_layout
from tandem.models.qwen3_moe.model import is_sparse

__all__ = ["HF_IGNORED", "hf_layout", "experts_layout"]


def experts_layout(hf: str, ours: str, num_experts: int, hidden_dim: int) -> dict[str, Layout]:
    """Experts `hf`.{e}.gate_proj/up_proj/down_proj.weight ↔ `ours`.w_gate_up [E, 2I, H], w_down [E, H, I]."""
    gate_up = Stack(
        tuple(
            Concat(
                (Source(f"{hf}.{e}.gate_proj.weight"), Source(f"{hf}.{e}.up_proj.weight")),
                (hidden_dim, hidden_dim),
            )
            for e in range(num_experts)
        )
    )
    down = Stack(tuple(Source(f"{hf}.{e}.down_proj.weight") for e in range(num_experts)))
    return {f"{ours}.w_gate_up": gate_up, f"{ours}.w_down": down}


def hf_layout(config: PretrainedConfig) -> dict[str, Layout]:
    layout = outer_layout(config)
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.mlp", f"layers.{i}.mlp"
        layout |= block_layout(config, i)
        if is_sparse(config, i):
            layout[f"{ours}.router.weight"] = Source(f"{hf}.gate.weight")
            layout |= experts_layout(f"{hf}.experts", f"{ours}.experts", config.num_experts,
                                     config.moe_intermediate_size)  # fmt: skip
        else:
            layout |= dense_mlp_layout(hf, ours, config.intermediate_size)
    return layout
