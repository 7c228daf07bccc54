"""MiniMax-M2: QK norm over the whole q and k projections, partial rotary (layers.py's
Attention); every layer a mixture of experts under Mixtral's names (`block_sparse_moe`,
experts' `w1`/`w3`/`w2`) with the router's correction bias beside the router (moe.py)."""

from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.models.layers import Attention
from tandem.inference.engine.models.moe import MoeCausalLM, SparseMoeBlock
from tandem.models.minimax_m2.model import check, router_spec
from tandem.models.minimax_m2.state_dict_adapter import EXPERT_NAMES


class MiniMaxM2ForCausalLM(MoeCausalLM):
    check = staticmethod(check)
    mlp_name = "block_sparse_moe"
    expert_names = EXPERT_NAMES
    rename = (".mlp.", ".block_sparse_moe.")  # transformers holds the block as `mlp`

    @classmethod
    def expert_size(cls, config: PretrainedConfig) -> int:
        return config.intermediate_size

    def attention(self, config: PretrainedConfig, index: int) -> nn.Module:
        return Attention(config, qk_norm="full")

    def mlp(self, config: PretrainedConfig, index: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, router_spec(config), EXPERT_NAMES,
                              bias_beside_gate=True)  # fmt: skip
