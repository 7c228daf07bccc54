"""Qwen3 checkpoint names ↔ tandem's: q/k/v and gate/up are fused, everything else renamed 1:1."""

from transformers import PretrainedConfig

from tandem.models.hf_checkpoint import Concat, Layout, Source
from tandem.models.qwen3.model import head_dim

HF_IGNORED = ("lm_head.weight",)  # present in some tied checkpoints; the embedding is the head then


def attention_layout(config: PretrainedConfig, i: int) -> dict[str, Layout]:
    hf, ours = f"model.layers.{i}.self_attn", f"layers.{i}.attention"
    q = config.num_attention_heads * head_dim(config)
    kv = config.num_key_value_heads * head_dim(config)
    layout: dict[str, Layout] = {
        f"{ours}.wqkv.weight": Concat(tuple(Source(f"{hf}.{p}_proj.weight") for p in "qkv"), (q, kv, kv)),
        f"{ours}.wo.weight": Source(f"{hf}.o_proj.weight"),
        f"{ours}.q_norm.weight": Source(f"{hf}.q_norm.weight"),
        f"{ours}.k_norm.weight": Source(f"{hf}.k_norm.weight"),
    }
    if config.attention_bias:
        layout[f"{ours}.wqkv.bias"] = Concat(tuple(Source(f"{hf}.{p}_proj.bias") for p in "qkv"), (q, kv, kv))
        layout[f"{ours}.wo.bias"] = Source(f"{hf}.o_proj.bias")
    return layout


def dense_mlp_layout(hf: str, ours: str, hidden_dim: int) -> dict[str, Layout]:
    """A SwiGLU MLP: HF gate_proj/up_proj/down_proj under `hf`, tandem's w_gate_up/w_down under `ours`."""
    gate_up = Concat(
        (Source(f"{hf}.gate_proj.weight"), Source(f"{hf}.up_proj.weight")), (hidden_dim, hidden_dim)
    )
    return {f"{ours}.w_gate_up.weight": gate_up, f"{ours}.w_down.weight": Source(f"{hf}.down_proj.weight")}


def block_layout(config: PretrainedConfig, i: int) -> dict[str, Layout]:
    """One block's norms and attention (the MLP is the family's)."""
    return {
        f"layers.{i}.attention_norm.weight": Source(f"model.layers.{i}.input_layernorm.weight"),
        f"layers.{i}.mlp_norm.weight": Source(f"model.layers.{i}.post_attention_layernorm.weight"),
        **attention_layout(config, i),
    }


def outer_layout(config: PretrainedConfig) -> dict[str, Layout]:
    """Embedding, final norm and (untied) output head."""
    layout: dict[str, Layout] = {
        "embed.weight": Source("model.embed_tokens.weight"),
        "norm.weight": Source("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        layout["head.weight"] = Source("lm_head.weight")
    return layout


def hf_layout(config: PretrainedConfig) -> dict[str, Layout]:
    layout = outer_layout(config)
    for i in range(config.num_hidden_layers):
        layout |= block_layout(config, i)
        layout |= dense_mlp_layout(f"model.layers.{i}.mlp", f"layers.{i}.mlp", config.intermediate_size)
    return layout
