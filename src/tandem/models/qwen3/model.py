"""Qwen3 dense: grouped-query attention with per-head QK RMSNorm, RoPE, SwiGLU MLP, pre-norm.

Built from the checkpoint's transformers config; fields whose values this implementation does
not cover (sliding-window layers, another activation, dynamic RoPE...) fail here, naming the
field, rather than as a shape error or a silent difference later.
"""

from transformers import PretrainedConfig

from tandem.models.layers.mlp import MLP
from tandem.models.layers.rotary import RotaryEmbedding, rope_frequencies
from tandem.models.layers.transformer import Attention, CausalLM, DecoderLayer
from tandem.models.registry import require


def check_common(config: PretrainedConfig) -> None:
    """The fields Qwen3 and Qwen3-MoE share that tandem supports only in one setting."""
    require(config, "hidden_act", lambda v: v == "silu", "SwiGLU with silu only")
    require(config, "use_sliding_window", lambda v: not v, "full attention in every layer")
    require(
        config,
        "layer_types",
        lambda v: v is None or all(t == "full_attention" for t in v),
        "full attention in every layer",
    )
    require(config, "attention_dropout", lambda v: not v, "no attention dropout")


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary(config: PretrainedConfig) -> RotaryEmbedding:
    params = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": config.rope_theta,
    }
    inv_freq, scaling = rope_frequencies(params, head_dim(config), 1.0, config.max_position_embeddings)
    return RotaryEmbedding(inv_freq, scaling)


def attention(config: PretrainedConfig) -> Attention:
    return Attention(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim(config),
        qk_norm="head",
        eps=config.rms_norm_eps,
        qkv_bias=bool(config.attention_bias),
        out_bias=bool(config.attention_bias),
    )


def build(config: PretrainedConfig, attention_backend: str) -> CausalLM:
    check_common(config)
    layers = [
        DecoderLayer(attention(config), MLP(config.hidden_size, config.intermediate_size), config.hidden_size,
                     config.rms_norm_eps)
        for _ in range(config.num_hidden_layers)
    ]  # fmt: skip
    return CausalLM(
        config.vocab_size,
        config.hidden_size,
        layers,
        rotary(config),
        config.rms_norm_eps,
        bool(config.tie_word_embeddings),
        attention_backend,
    )
