"""MiniMax-M2 checkpoint names ↔ tandem's: Llama-style attention with q_norm/k_norm over the
whole projection; the mixture of experts is `block_sparse_moe` (Mixtral's names): its router
`gate`, its correction bias `e_score_correction_bias` beside the router, and per-expert
`experts.{e}.w1` (gate), `w3` (up), `w2` (down), stacked."""

from transformers import PretrainedConfig

from tandem.models.hf_checkpoint import Layout, Source
from tandem.models.layouts import TIED_HEAD, attention_layout, experts_layout, norms_layout, outer_layout

HF_IGNORED = TIED_HEAD
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def hf_layout(config: PretrainedConfig) -> dict[str, Layout]:
    layout = outer_layout(config)
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.block_sparse_moe", f"layers.{i}.mlp"
        layout |= norms_layout(i)
        layout |= attention_layout(config, i, qk_norm=True, qkv_bias=False, out_bias=False)
        layout[f"{ours}.router.weight"] = Source(f"{hf}.gate.weight")
        layout[f"{ours}.router.e_score_correction_bias"] = Source(f"{hf}.e_score_correction_bias")
        layout |= experts_layout(f"{hf}.experts", f"{ours}.experts", config.num_local_experts,
                                 config.intermediate_size, EXPERT_NAMES)  # fmt: skip
    return layout
