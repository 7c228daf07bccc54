"""Qwen3 (dense): every layer's MLP is a gated MLP; the rest is the shared layers (layers.py)."""

from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.models.layers import CausalLM, GatedMLP


class Qwen3ForCausalLM(CausalLM):
    def mlp(self, config: PretrainedConfig, index: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size)
