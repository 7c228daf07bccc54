"""Checkpoint layouts of the parts most decoder families share, under their usual Hugging Face
names (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`, `mlp.gate_proj`, per-expert
`experts.{e}.*`...): a family's state-dict adapter assembles its layout from these and adds
what is its own. tandem fuses q/k/v and gate/up into one projection each and stacks experts into
[experts, out, in] weights; these layouts say how (models/hf_checkpoint.py).
"""

from transformers import PretrainedConfig

from tandem.models.decoder_config import head_dim
from tandem.models.hf_checkpoint import Concat, Layout, Source, Stack

TIED_HEAD = ("lm_head.weight",)  # present in some tied checkpoints; the embedding is the head then


def outer_layout(config: PretrainedConfig) -> dict[str, Layout]:
    """Embedding, final norm and (untied) output head."""
    layout: dict[str, Layout] = {
        "embed.weight": Source("model.embed_tokens.weight"),
        "norm.weight": Source("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        layout["head.weight"] = Source("lm_head.weight")
    return layout


def norms_layout(i: int) -> dict[str, Layout]:
    """The two pre-norms of block `i`."""
    return {
        f"layers.{i}.attention_norm.weight": Source(f"model.layers.{i}.input_layernorm.weight"),
        f"layers.{i}.mlp_norm.weight": Source(f"model.layers.{i}.post_attention_layernorm.weight"),
    }


def attention_layout(
    config: PretrainedConfig, i: int, qk_norm: bool, qkv_bias: bool, out_bias: bool
) -> dict[str, Layout]:
    """q/k/v/o projections of block `i` (q, k, v fused), with the optional q/k norms and biases."""
    hf, ours = f"model.layers.{i}.self_attn", f"layers.{i}.attention"
    q = config.num_attention_heads * head_dim(config)
    kv = config.num_key_value_heads * head_dim(config)
    layout: dict[str, Layout] = {
        f"{ours}.wqkv.weight": Concat(tuple(Source(f"{hf}.{p}_proj.weight") for p in "qkv"), (q, kv, kv)),
        f"{ours}.wo.weight": Source(f"{hf}.o_proj.weight"),
    }
    if qk_norm:
        layout[f"{ours}.q_norm.weight"] = Source(f"{hf}.q_norm.weight")
        layout[f"{ours}.k_norm.weight"] = Source(f"{hf}.k_norm.weight")
    if qkv_bias:
        layout[f"{ours}.wqkv.bias"] = Concat(tuple(Source(f"{hf}.{p}_proj.bias") for p in "qkv"), (q, kv, kv))
    if out_bias:
        layout[f"{ours}.wo.bias"] = Source(f"{hf}.o_proj.bias")
    return layout


def dense_mlp_layout(hf: str, ours: str, hidden_dim: int) -> dict[str, Layout]:
    """A SwiGLU MLP: HF gate_proj/up_proj/down_proj under `hf`, tandem's w_gate_up/w_down under `ours`."""
    gate_up = Concat(
        (Source(f"{hf}.gate_proj.weight"), Source(f"{hf}.up_proj.weight")), (hidden_dim, hidden_dim)
    )
    return {f"{ours}.w_gate_up.weight": gate_up, f"{ours}.w_down.weight": Source(f"{hf}.down_proj.weight")}


def experts_layout(
    hf: str,
    ours: str,
    num_experts: int,
    hidden_dim: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> dict[str, Layout]:
    """Experts `hf`.{e}.<gate>/<up>/<down>.weight ↔ `ours`.w_gate_up [E, 2I, H], w_down [E, H, I];
    `names` are the checkpoint's names of the gate, up and down projections."""
    gate, up, down = names
    gate_up = Stack(
        tuple(
            Concat(
                (Source(f"{hf}.{e}.{gate}.weight"), Source(f"{hf}.{e}.{up}.weight")), (hidden_dim, hidden_dim)
            )
            for e in range(num_experts)
        )
    )
    stacked_down = Stack(tuple(Source(f"{hf}.{e}.{down}.weight") for e in range(num_experts)))
    return {f"{ours}.w_gate_up": gate_up, f"{ours}.w_down": stacked_down}
