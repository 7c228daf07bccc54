"""Reading the transformers config fields that tandem's decoder families share.

Each helper turns a field into what the shared layers take (a head width, a rotary embedding)
or refuses a value the layers do not implement, naming the field (registry.require), so an
unsupported checkpoint fails at load rather than as a shape error or a silent difference.
"""

from torch import nn
from transformers import PretrainedConfig

from tandem.models.layers.rotary import RotaryEmbedding, rope_frequencies
from tandem.models.layers.transformer import Attention, CausalLM
from tandem.models.registry import require


def check_common(config: PretrainedConfig, layer_type: str | tuple[str, ...] = "full_attention") -> None:
    """Fields every family here supports in one setting only: SwiGLU with silu, one attention
    type in every layer (`layer_type`, or any of several names for it: no sliding window), no
    attention dropout."""
    names = (layer_type,) if isinstance(layer_type, str) else layer_type
    require(config, "hidden_act", lambda v: v == "silu", "SwiGLU with silu only")
    require(config, "use_sliding_window", lambda v: not v, "full attention in every layer")
    require(
        config,
        "layer_types",
        lambda v: v is None or all(t in names for t in v),
        f"{' or '.join(names)} in every layer",
    )
    require(config, "attention_dropout", lambda v: not v, "no attention dropout")


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: PretrainedConfig) -> dict:
    return getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": config.rope_theta,
    }


def partial_rotary_factor(config: PretrainedConfig) -> float:
    """The fraction of each head's channels that rotate (transformers keeps it in rope_parameters)."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    return float(factor if factor is not None else getattr(config, "partial_rotary_factor", None) or 1.0)


def rotary(config: PretrainedConfig, rotated_head_dim: int | None = None) -> RotaryEmbedding:
    """The rotary embedding of `config`: over `rotated_head_dim` (default: the head width) times
    the partial rotary factor."""
    width = rotated_head_dim or head_dim(config)
    factor = partial_rotary_factor(config)
    inv_freq, scaling = rope_frequencies(
        rope_parameters(config), width, factor, config.max_position_embeddings
    )
    return RotaryEmbedding(inv_freq, scaling)


def gqa_attention(config: PretrainedConfig, qk_norm: str | None, qkv_bias: bool, out_bias: bool) -> Attention:
    """Grouped-query attention of the config's heads, with the family's QK norm and biases."""
    return Attention(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim(config),
        qk_norm=qk_norm,
        eps=config.rms_norm_eps,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
    )


def causal_lm(
    config: PretrainedConfig,
    layers: list[nn.Module],
    attention_backend: str,
    rotary_embedding: RotaryEmbedding | None = None,
    cls: type[CausalLM] = CausalLM,
) -> CausalLM:
    """The decoder shell around a family's layers: the config's vocabulary, width, norm epsilon,
    tying, and its rotary embedding unless the family brings its own."""
    return cls(
        config.vocab_size,
        config.hidden_size,
        layers,
        rotary_embedding or rotary(config),
        config.rms_norm_eps,
        bool(config.tie_word_embeddings),
        attention_backend,
    )
