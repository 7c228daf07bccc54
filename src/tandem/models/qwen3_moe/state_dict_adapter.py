"""Qwen3-MoE checkpoint names ↔ tandem's: per-expert gate/up/down tensors stacked into
[experts, out, in] weights; the router is `mlp.gate`; the rest is Qwen3's mapping."""

from transformers import PretrainedConfig

from tandem.models.hf_checkpoint import Layout, Source
from tandem.models.layouts import TIED_HEAD, dense_mlp_layout, experts_layout, outer_layout
from tandem.models.qwen3.state_dict_adapter import block_layout
from tandem.models.qwen3_moe.model import is_sparse

HF_IGNORED = TIED_HEAD


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
