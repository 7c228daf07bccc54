"""MiniMax-M2: grouped-query attention with QK RMSNorm over the whole q and k projections (not
per head), partial rotary embedding, and a mixture of experts in every layer, without shared
experts.

Routing is sigmoid with the score-correction bias (it picks the experts, the unbiased scores
weight them), always renormalised over the chosen experts. Fields of the published config that
transformers ignores are checked where they name something else than what both implement
(another scoring function, a per-head QK norm, layers of another attention type).
"""

from transformers import PretrainedConfig

from tandem.models.decoder_config import causal_lm, check_common, gqa_attention
from tandem.models.layers.moe import MoE, RouterSpec
from tandem.models.layers.transformer import CausalLM, DecoderLayer
from tandem.models.registry import require


def check(config: PretrainedConfig) -> None:
    """Every field check of MiniMax-M2 (the engine runs it too); the published checkpoint's own
    fields are absent from transformers' config class."""
    check_common(config)
    require(config, "scoring_func", lambda v: v in (None, "sigmoid"), "sigmoid routing")
    require(config, "use_routing_bias", lambda v: v in (None, True), "routing with the correction bias")
    require(config, "use_qk_norm", lambda v: v in (None, True), "QK norm")
    require(config, "qk_norm_type", lambda v: v in (None, "per_layer"), "QK norm over the whole projection")
    require(
        config,
        "attn_type_list",
        lambda v: v is None or all(t == 1 for t in v),
        "full attention in every layer",
    )
    require(config, "router_jitter_noise", lambda v: not v, "no router jitter")


def router_spec(config: PretrainedConfig) -> RouterSpec:
    return RouterSpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        score="sigmoid",
        renormalize=True,
        correction_bias=True,
    )


def build(config: PretrainedConfig, attention_backend: str) -> CausalLM:
    check(config)
    dim, eps = config.hidden_size, config.rms_norm_eps
    layers = [
        DecoderLayer(gqa_attention(config, "full", qkv_bias=False, out_bias=False),
                     MoE(dim, config.intermediate_size, router_spec(config)), dim, eps)
        for _ in range(config.num_hidden_layers)
    ]  # fmt: skip
    return causal_lm(config, layers, attention_backend)
