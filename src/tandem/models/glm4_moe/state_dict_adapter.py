"""GLM-4.5 checkpoint names ↔ tandem's: Llama-style attention (q/k/v fused, biased when
`attention_bias`, q_norm/k_norm when `use_qk_norm`); a sparse layer's router is `mlp.gate`
with its correction bias `mlp.gate.e_score_correction_bias`, its experts per-expert tensors
stacked, its shared experts `mlp.shared_experts`. The MTP layer is ignored."""

from transformers import PretrainedConfig

from tandem.models.glm4_moe.model import is_sparse
from tandem.models.hf_checkpoint import Layout, Source
from tandem.models.layouts import (
    TIED_HEAD,
    attention_layout,
    dense_mlp_layout,
    experts_layout,
    norms_layout,
    outer_layout,
)


def hf_ignored(config: PretrainedConfig) -> tuple[str, ...]:
    """The tied head's copy, and the multi-token-prediction layers after the last decoder layer."""
    mtp = getattr(config, "num_nextn_predict_layers", None) or 0
    return (*TIED_HEAD, *(f"model.layers.{config.num_hidden_layers + j}." for j in range(mtp)))


def moe_layout(config: PretrainedConfig, i: int) -> dict[str, Layout]:
    """A sparse layer's router, correction bias, routed and shared experts (GLM-4.5 and GLM-5)."""
    hf, ours = f"model.layers.{i}.mlp", f"layers.{i}.mlp"
    shared = config.moe_intermediate_size * config.n_shared_experts
    return {
        f"{ours}.router.weight": Source(f"{hf}.gate.weight"),
        f"{ours}.router.e_score_correction_bias": Source(f"{hf}.gate.e_score_correction_bias"),
        **experts_layout(
            f"{hf}.experts", f"{ours}.experts", config.n_routed_experts, config.moe_intermediate_size
        ),
        **dense_mlp_layout(f"{hf}.shared_experts", f"{ours}.shared", shared),
    }


def mlp_layout(config: PretrainedConfig, i: int, sparse: bool) -> dict[str, Layout]:
    if sparse:
        return moe_layout(config, i)
    return dense_mlp_layout(f"model.layers.{i}.mlp", f"layers.{i}.mlp", config.intermediate_size)


def hf_layout(config: PretrainedConfig) -> dict[str, Layout]:
    layout = outer_layout(config)
    for i in range(config.num_hidden_layers):
        layout |= norms_layout(i)
        layout |= attention_layout(
            config, i, qk_norm=bool(config.use_qk_norm), qkv_bias=bool(config.attention_bias), out_bias=False
        )
        layout |= mlp_layout(config, i, is_sparse(config, i))
    return layout
