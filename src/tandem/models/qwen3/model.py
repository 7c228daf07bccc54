"""Qwen3 dense: grouped-query attention with per-head QK RMSNorm, RoPE, SwiGLU MLP, pre-norm.

Built from the checkpoint's transformers config; fields whose values this implementation does
not cover (sliding-window layers, another activation, dynamic RoPE...) fail here, naming the
field, rather than as a shape error or a silent difference later.
"""

from transformers import PretrainedConfig

from tandem.models.decoder_config import check_common, head_dim, rotary
from tandem.models.layers.mlp import MLP
from tandem.models.layers.transformer import Attention, CausalLM, DecoderLayer


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
