"""Qwen3-MoE: Qwen3's attention with a mixture of experts in place of the MLP.

Routing is softmax over all experts, top-k, renormalised when `norm_topk_prob`; no shared
experts. A layer is sparse unless listed in `mlp_only_layers` or skipped by
`decoder_sparse_step`, as in the reference. The router's auxiliary load-balancing loss is not
added to the training loss (`router_aux_loss_coef` is ignored); expert load is logged instead.
"""

from transformers import PretrainedConfig

from tandem.models.decoder_config import causal_lm, check_common
from tandem.models.layers.mlp import MLP
from tandem.models.layers.moe import MoE, RouterSpec
from tandem.models.layers.transformer import CausalLM, DecoderLayer
from tandem.models.qwen3.model import attention


def is_sparse(config: PretrainedConfig, i: int) -> bool:
    return (
        i not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (i + 1) % config.decoder_sparse_step == 0
    )


def router_spec(config: PretrainedConfig) -> RouterSpec:
    return RouterSpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        score="softmax",
        renormalize=bool(config.norm_topk_prob),
    )


def build(config: PretrainedConfig, attention_backend: str) -> CausalLM:
    check_common(config)
    dim, eps = config.hidden_size, config.rms_norm_eps
    layers = []
    for i in range(config.num_hidden_layers):
        if is_sparse(config, i):
            mlp = MoE(dim, config.moe_intermediate_size, router_spec(config))
        else:
            mlp = MLP(dim, config.intermediate_size)
        layers.append(DecoderLayer(attention(config), mlp, dim, eps))
    return causal_lm(config, layers, attention_backend)
