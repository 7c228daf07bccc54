"""GLM-4.5: grouped-query attention with biased q/k/v and optional per-head QK RMSNorm, partial
rotary embedding, the first `first_k_dense_replace` layers dense and the rest a mixture of
experts with shared experts.

Routing is sigmoid with the score-correction bias of aux-loss-free balancing (it picks the
experts, the unbiased scores weight them), optionally grouped (`n_group`, `topk_group`),
renormalised when `norm_topk_prob`, times `routed_scaling_factor`. The shared experts are one
SwiGLU MLP of `moe_intermediate_size × n_shared_experts`, always on. The multi-token-prediction
layer of published checkpoints (`model.layers.{num_hidden_layers}`) is loaded by nothing and
not trained (the state-dict adapter lists it as ignored), as transformers does.
"""

from transformers import PretrainedConfig

from tandem.models.decoder_config import causal_lm, check_common, gqa_attention
from tandem.models.layers.mlp import MLP
from tandem.models.layers.moe import MoE, RouterSpec
from tandem.models.layers.transformer import Attention, CausalLM, DecoderLayer
from tandem.models.registry import require


def is_sparse(config: PretrainedConfig, i: int) -> bool:
    return i >= config.first_k_dense_replace


def check_moe(config: PretrainedConfig) -> None:
    """The MoE fields GLM-4.5 and GLM-5 support in one setting only."""
    require(
        config, "n_group", lambda v: v and config.n_routed_experts % v == 0, "groups that divide the experts"
    )
    require(config, "n_shared_experts", lambda v: v is not None and v >= 1, "at least one shared expert")


def check(config: PretrainedConfig) -> None:
    """Every field check of GLM-4.5 (the engine runs it too)."""
    check_common(config)
    check_moe(config)


def router_spec(config: PretrainedConfig) -> RouterSpec:
    """Sigmoid routing with correction bias, grouped and scaled (GLM-4.5 and GLM-5 share it)."""
    return RouterSpec(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        score="sigmoid",
        renormalize=bool(config.norm_topk_prob),
        routed_scaling=float(config.routed_scaling_factor),
        correction_bias=True,
        groups=config.n_group,
        top_groups=config.topk_group,
        fp32_weight=True,  # as transformers keeps `gate.weight`
    )


def moe(config: PretrainedConfig) -> MoE:
    size = config.moe_intermediate_size
    return MoE(
        config.hidden_size, size, router_spec(config), shared_hidden_dim=size * config.n_shared_experts
    )


def attention(config: PretrainedConfig) -> Attention:
    qk_norm = "head" if config.use_qk_norm else None
    return gqa_attention(config, qk_norm, qkv_bias=bool(config.attention_bias), out_bias=False)


def build(config: PretrainedConfig, attention_backend: str) -> CausalLM:
    check(config)
    dim, eps = config.hidden_size, config.rms_norm_eps
    layers = [
        DecoderLayer(attention(config), moe(config) if is_sparse(config, i) else MLP(dim, config.intermediate_size),
                     dim, eps)
        for i in range(config.num_hidden_layers)
    ]  # fmt: skip
    return causal_lm(config, layers, attention_backend)
