"""Qwen3-MoE: Qwen3's layers with a mixture of experts (moe.py: softmax routing, top-k,
renormalised when `norm_topk_prob`) as the MLP of its sparse layers."""

from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.models.layers import GatedMLP
from tandem.inference.engine.models.moe import MoeCausalLM, SparseMoeBlock
from tandem.models.qwen3_moe.model import is_sparse, router_spec


class Qwen3MoeForCausalLM(MoeCausalLM):
    def mlp(self, config: PretrainedConfig, index: int) -> nn.Module:
        if is_sparse(config, index):
            return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, router_spec(config))
        return GatedMLP(config.hidden_size, config.intermediate_size)
