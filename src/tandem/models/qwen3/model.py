"""Qwen3 dense: grouped-query attention with per-head QK RMSNorm, RoPE, SwiGLU MLP, pre-norm.

Built from the checkpoint's transformers config; fields whose values this implementation does
not cover (sliding-window layers, another activation, dynamic RoPE...) fail here, naming the
field, rather than as a shape error or a silent difference later.
"""

from transformers import PretrainedConfig

from tandem.models.decoder_config import causal_lm, check_common, gqa_attention
from tandem.models.layers.mlp import MLP
from tandem.models.layers.transformer import Attention, CausalLM, DecoderLayer


def attention(config: PretrainedConfig) -> Attention:
    bias = bool(config.attention_bias)
    return gqa_attention(config, "head", qkv_bias=bias, out_bias=bias)


def build(config: PretrainedConfig, attention_backend: str) -> CausalLM:
    check_common(config)
    layers = [
        DecoderLayer(attention(config), MLP(config.hidden_size, config.intermediate_size), config.hidden_size,
                     config.rms_norm_eps)
        for _ in range(config.num_hidden_layers)
    ]  # fmt: skip
    return causal_lm(config, layers, attention_backend)
