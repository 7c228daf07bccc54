"""Qwen3 checkpoint names ↔ tandem's: q/k/v and gate/up are fused, everything else renamed 1:1."""

from transformers import PretrainedConfig

from tandem.models.hf_checkpoint import Layout
from tandem.models.layouts import TIED_HEAD, attention_layout, dense_mlp_layout, norms_layout, outer_layout

HF_IGNORED = TIED_HEAD


def block_layout(config: PretrainedConfig, i: int) -> dict[str, Layout]:
    """One block's norms and attention (the MLP is the family's)."""
    bias = bool(config.attention_bias)
    return norms_layout(i) | attention_layout(config, i, qk_norm=True, qkv_bias=bias, out_bias=bias)


def hf_layout(config: PretrainedConfig) -> dict[str, Layout]:
    layout = outer_layout(config)
    for i in range(config.num_hidden_layers):
        layout |= block_layout(config, i)
        layout |= dense_mlp_layout(f"model.layers.{i}.mlp", f"layers.{i}.mlp", config.intermediate_size)
    return layout
