"""GLM-4.5: biased q/k/v, per-head QK norm when `use_qk_norm`, partial rotary (layers.py's
Attention); the first `first_k_dense_replace` layers dense, the rest the trainer's sigmoid
router with correction bias and groups over routed experts plus shared experts (moe.py)."""

from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.models.layers import Attention, GatedMLP
from tandem.inference.engine.models.moe import MoeCausalLM, SparseMoeBlock
from tandem.models.glm4_moe.model import check, is_sparse, router_spec


def glm_moe_block(config: PretrainedConfig) -> SparseMoeBlock:
    """GLM's mixture of experts (GLM-4.5 and GLM-5 share it)."""
    size = config.moe_intermediate_size
    return SparseMoeBlock(
        config.hidden_size, size, router_spec(config), shared_intermediate=size * config.n_shared_experts
    )


class Glm4MoeForCausalLM(MoeCausalLM):
    check = staticmethod(check)

    def attention(self, config: PretrainedConfig, index: int) -> nn.Module:
        return Attention(config, qk_norm="head" if config.use_qk_norm else None, out_bias=False)

    def mlp(self, config: PretrainedConfig, index: int) -> nn.Module:
        if is_sparse(config, index):
            return glm_moe_block(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)
