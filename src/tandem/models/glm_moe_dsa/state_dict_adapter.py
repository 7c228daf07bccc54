"""GLM-5 checkpoint names ↔ tandem's: MLA's `q_a_proj` and `kv_a_proj_with_mqa` fused into one
projection, its norms and up-projections renamed, the indexer's tensors (full layers only)
under `self_attn.indexer`; the MLPs and the MTP layer as GLM-4.5's."""

from transformers import PretrainedConfig

from tandem.models.glm4_moe.state_dict_adapter import hf_ignored, mlp_layout
from tandem.models.glm_moe_dsa.model import has_indexer, is_sparse
from tandem.models.hf_checkpoint import Concat, Layout, Source
from tandem.models.layouts import norms_layout, outer_layout

__all__ = ["hf_ignored", "hf_layout"]


def attention_layout(config: PretrainedConfig, i: int) -> dict[str, Layout]:
    hf, ours = f"model.layers.{i}.self_attn", f"layers.{i}.attention"
    sizes = (config.q_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim)
    layout: dict[str, Layout] = {
        f"{ours}.wq_kv_a.weight": Concat(
            (Source(f"{hf}.q_a_proj.weight"), Source(f"{hf}.kv_a_proj_with_mqa.weight")), sizes
        ),
        f"{ours}.q_norm.weight": Source(f"{hf}.q_a_layernorm.weight"),
        f"{ours}.wq_b.weight": Source(f"{hf}.q_b_proj.weight"),
        f"{ours}.kv_norm.weight": Source(f"{hf}.kv_a_layernorm.weight"),
        f"{ours}.wkv_b.weight": Source(f"{hf}.kv_b_proj.weight"),
        f"{ours}.wo.weight": Source(f"{hf}.o_proj.weight"),
    }
    if config.attention_bias:
        layout[f"{ours}.wq_kv_a.bias"] = Concat(
            (Source(f"{hf}.q_a_proj.bias"), Source(f"{hf}.kv_a_proj_with_mqa.bias")), sizes
        )
        layout[f"{ours}.wo.bias"] = Source(f"{hf}.o_proj.bias")
    if has_indexer(config, i):
        for own, theirs in [("wq", "wq_b"), ("wk", "wk"), ("weights_proj", "weights_proj")]:
            layout[f"{ours}.indexer.{own}.weight"] = Source(f"{hf}.indexer.{theirs}.weight")
        layout[f"{ours}.indexer.k_norm.weight"] = Source(f"{hf}.indexer.k_norm.weight")
        layout[f"{ours}.indexer.k_norm.bias"] = Source(f"{hf}.indexer.k_norm.bias")
    return layout


def hf_layout(config: PretrainedConfig) -> dict[str, Layout]:
    layout = outer_layout(config)
    for i in range(config.num_hidden_layers):
        layout |= norms_layout(i) | attention_layout(config, i) | mlp_layout(config, i, is_sparse(config, i))
    return layout
