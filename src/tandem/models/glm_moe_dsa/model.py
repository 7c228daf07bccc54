"""GLM-5: multi-head latent attention with DeepSeek sparse attention (layers/mla.py, dsa.py),
the first layers dense (`mlp_layer_types`) and the rest GLM-4.5's mixture of experts (sigmoid
routing with correction bias, grouped, scaled, shared experts).

A layer whose `indexer_types` entry is "full" runs its own indexer; a "shared" one attends to
the keys the previous full layer chose, so the choice is passed from layer to layer
(`IndexedCausalLM.blocks`): an explicit argument and result, so recomputation under activation
checkpointing sees the same choice. The attention backend picks the path: `sdpa` and
`sdpa_docs` the dense mask (any device, the reference), `flex`, `varlen` (and `auto` on CUDA)
the sparse one. The indexer is frozen, as in transformers' reference. The multi-token-prediction
layer of published checkpoints (`model.layers.{num_hidden_layers}`) is not loaded.
"""

import math

import torch
from transformers import PretrainedConfig

from tandem.models.decoder_config import causal_lm, check_common, rope_parameters, rotary
from tandem.models.glm4_moe.model import check_moe, moe
from tandem.models.layers.dsa import Indexer, TokenDocuments
from tandem.models.layers.mla import LatentAttention
from tandem.models.layers.mlp import MLP
from tandem.models.layers.transformer import CausalLM, DecoderLayer
from tandem.models.registry import require

DENSE_BACKENDS = ("sdpa", "sdpa_docs")


def is_sparse(config: PretrainedConfig, i: int) -> bool:
    return config.mlp_layer_types[i] == "sparse"


def has_indexer(config: PretrainedConfig, i: int) -> bool:
    return config.indexer_types[i] == "full"


def check(config: PretrainedConfig) -> None:
    """Every field check of GLM-5 (the engine runs it too)."""
    # published checkpoints' config.json (and transformers up to ~5.17) name the layers
    # deepseek_sparse_attention; later transformers name them indexed_attention
    check_common(config, layer_type=("indexed_attention", "deepseek_sparse_attention"))
    check_moe(config)
    require(config, "q_lora_rank", lambda v: bool(v), "a low-rank query projection")
    require(config, "num_key_value_heads", lambda v: v == config.num_attention_heads,
            "one latent KV per query head (num_key_value_heads = num_attention_heads)")  # fmt: skip
    require(config, "indexer_types", lambda v: v[0] == "full" and set(v) <= {"full", "shared"},
            "a full indexer in the first layer, then full or shared")  # fmt: skip
    require(config, "mlp_layer_types", lambda v: set(v) <= {"dense", "sparse"}, "dense or sparse MLPs")


def attention_scale(config: PretrainedConfig) -> float:
    """1/√(qk_head_dim), times YaRN's mscale² where the checkpoint's rope scaling sets mscale_all_dim."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    factor = params.get("factor", 1.0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def attention(config: PretrainedConfig, i: int, sparse: bool) -> LatentAttention:
    indexer = None
    if has_indexer(config, i):
        indexer = Indexer(config.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim,
                          config.qk_rope_head_dim, config.index_topk)  # fmt: skip
    return LatentAttention(
        config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
        config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, attention_scale(config),
        bool(config.attention_bias), indexer, sparse,
    )  # fmt: skip


class IndexedDecoderLayer(DecoderLayer):
    """A pre-norm block whose attention takes and returns the indexer's choice."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: TokenDocuments,
        chosen: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, chosen = self.attention(self.attention_norm(x), cos, sin, docs, chosen)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), chosen


class IndexedCausalLM(CausalLM):
    supports_shared_prompts = False  # the indexer's documents (layers/dsa.py) know no branches
    dense_short_documents = False  # model.sparse_attention = "long_documents" (layers/dsa.py)

    def documents(self, position_ids: torch.Tensor) -> TokenDocuments:
        """MLA layers find documents per token (layers/dsa.py), under context parallelism too."""
        return TokenDocuments.from_positions(position_ids)

    def blocks(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: TokenDocuments,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """MLA layers pass the indexer's choice on; where no document is longer than its top-k
        (and `dense_short_documents`), they attend to every visible key instead."""
        if (
            self.dense_short_documents
            and int(docs.position_ids.max()) < self.layers[0].attention.indexer.topk
        ):
            docs = docs.with_packed(self.attention_backend)
        chosen = None
        for index, layer in enumerate(self.layers, start=1):
            self.await_weights(index)
            x, chosen = layer(x, cos, sin, docs, chosen)
        return x


def build(config: PretrainedConfig, attention_backend: str) -> CausalLM:
    check(config)
    dim, eps = config.hidden_size, config.rms_norm_eps
    sparse = attention_backend not in DENSE_BACKENDS
    layers = [
        IndexedDecoderLayer(attention(config, i, sparse),
                            moe(config) if is_sparse(config, i) else MLP(dim, config.intermediate_size), dim, eps)
        for i in range(config.num_hidden_layers)
    ]  # fmt: skip
    return causal_lm(
        config, layers, attention_backend, rotary(config, config.qk_rope_head_dim), IndexedCausalLM
    )
