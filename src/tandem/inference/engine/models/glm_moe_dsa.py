"""GLM-5: multi-head latent attention over a compressed paged cache, with the sparse-attention
indexer choosing the keys of every query, prefill and decode alike; GLM-4.5's mixture of experts.

The cache holds per token and layer what MLA compresses a token to — the normed latent c
(kv_lora_rank) and the rotated shared key k_rope (qk_rope_head_dim), one row of 576 channels
for GLM-5's shape, not the 64 heads' keys and values — and the indexer's key (index_head_dim).
Attention runs in the absorbed form (the trainer's layers/dsa.py states it): each query head's
no-position part is mapped into the latent space by W_UK once, scores are q_latent·c +
q_rope·k_rope against the cached rows, and the weighted latents are mapped out by W_UV, so
keys and values are never expanded. All query heads of a sequence share the one latent "KV
head"; they are laid out as its query rows, so one SDPA call serves a group of sequences.

Every query attends to the keys its layer's indexer chose among the keys visible to it (a
"shared" layer reuses the previous full layer's choice, passed in `AttentionMetadata.
index_choice`); prompts are attended over the cache like prompt chunks (`prompts_from_cache`),
so prefill and decode run the same code. The multi-token-prediction layer of published
checkpoints is not loaded (transformers drops it).
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.attention import AttentionMetadata
from tandem.inference.engine.models.glm4_moe import glm_moe_block
from tandem.inference.engine.models.layers import GatedMLP, RMSNorm, Rope
from tandem.inference.engine.models.moe import MoeCausalLM
from tandem.models.glm_moe_dsa.model import attention_scale, check, has_indexer, is_sparse
from tandem.models.layers.mla import LORA_NORM_EPS
from tandem.models.layers.rotary import apply_rotary_interleaved


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The interleaved rotation of x [T, heads, dim] by cos/sin [T, 1, dim]."""
    return apply_rotary_interleaved(x[None], cos[None, :, 0], sin[None, :, 0])[0]


class Indexer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.heads, self.dim, self.rope_dim = (
            config.index_n_heads,
            config.index_head_dim,
            config.qk_rope_head_dim,
        )
        self.topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)

    def _rotated(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = t.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        return torch.cat([_rotate(rot, cos, sin), rest], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The step's tokens' indexer keys [T, 1, dim] (what the cache stores)."""
        return self._rotated(self.k_norm(self.wk(x))[:, None], cos, sin)

    def queries(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, heads, dim] fp32, head weights [T, heads] fp32)."""
        q = self._rotated(self.wq_b(q_resid).view(x.shape[0], self.heads, self.dim), cos, sin)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads**-0.5
        return q.float(), weights

    def choose(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [B, Lq, heads, dim], weights [B, Lq, heads], keys [B, K, dim], visible [B, Lq, K] →
        the visible keys among each query's top-k by index score [B, Lq, K] (bool)."""
        scores = F.relu(torch.einsum("bqhd,bkd->bqhk", q, keys.float()) * self.dim**-0.5)
        index = torch.matmul(weights[:, :, None], scores).squeeze(-2).masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, chosen, True) & visible


class LatentAttention(nn.Module):
    """MLA with its parameters under the checkpoint's names (see the module docstring)."""

    def __init__(self, config: PretrainedConfig, indexer: bool) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.heads, self.rank, self.rope_dim = heads, config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.scale = attention_scale(config)
        bias = bool(config.attention_bias)
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, LORA_NORM_EPS)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        self.indexer = Indexer(config) if indexer else None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        latent_cache, index_cache = kv_cache  # [blocks, block_size, 1, rank + rope], [..., 1, index dim]
        cos, sin = rope.rows(x.dtype)
        q_resid = self.q_a_layernorm.normalize(self.q_a_proj(x))
        q_nope, q_rope = (
            self.q_b_proj(q_resid).view(tokens, self.heads, -1).split([self.nope_dim, self.rope_dim], -1)
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        row = torch.cat([self.kv_a_layernorm.normalize(latent), _rotate(k_rope[:, None], cos, sin)[:, 0]], -1)
        latent_cache.view(-1, row.shape[-1]).index_copy_(0, meta.slot_mapping, row)
        index_q = None
        if self.indexer is not None:
            index_cache.view(-1, index_cache.shape[-1]).index_copy_(
                0, meta.slot_mapping, self.indexer.keys(x, cos, sin)[:, 0]
            )
            index_q = self.indexer.queries(x, q_resid, cos, sin)
            meta.index_choice = []
        w_uk, w_uv = self.kv_b_proj.weight.view(self.heads, -1, self.rank).split(
            [self.nope_dim, self.v_dim], dim=1
        )
        queries = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), _rotate(q_rope, cos, sin)], dim=-1)
        out = queries.new_empty(tokens, self.heads, self.rank)
        for group, (rows, picks, index, tables, visible) in enumerate(_groups(meta, latent_cache.shape[1])):
            q = queries[index]  # [B, Lq, heads, rank + rope]
            keys = latent_cache[tables].flatten(1, 3)  # [B, K, rank + rope]
            if index_q is not None:
                iq, iw = index_q
                chosen = self.indexer.choose(iq[index], iw[index], index_cache[tables].flatten(1, 3), visible)
                meta.index_choice.append(chosen)
            else:
                chosen = meta.index_choice[group]
            latent_out = self._attend(q, keys, chosen)
            out[rows] = latent_out.flatten(0, 1)[picks] if picks is not None else latent_out.flatten(0, 1)
        return self.o_proj(torch.einsum("thl,hvl->thv", out, w_uv).reshape(tokens, -1))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [B, Lq, heads, rank + rope] over keys [B, K, rank + rope] where allowed [B, Lq, K]
        → latent outputs [B, Lq, heads, rank]: the heads laid out as query rows of one KV head."""
        batch, length, heads, width = q.shape
        mask = allowed[:, :, None].expand(-1, -1, heads, -1).reshape(batch, 1, length * heads, -1)
        o = F.scaled_dot_product_attention(
            q.reshape(batch, 1, length * heads, width), keys[:, None], keys[:, None, :, : self.rank],
            attn_mask=mask, scale=self.scale,
        )  # fmt: skip
        return o.view(batch, length, heads, self.rank)


def _groups(meta: AttentionMetadata, block_size: int) -> Iterator[tuple]:
    """The step's attention groups as (rows of the step to write, positions of the valid queries
    in the flattened [B · Lq] batch or None for all, query index [B, Lq], block tables [B, W],
    visible keys [B, Lq, W · block_size]): the decodes first (Lq = 1), then every chunk group."""
    if meta.prompts is not None:
        raise RuntimeError(
            "GLM-5 attends whole prompts over the cache: the runner must honour prompts_from_cache"
        )
    d = meta.decodes
    if d is not None:
        tables = d.block_tables
        keys = torch.arange(tables.shape[1] * block_size, device=tables.device)
        visible = (keys[None, :] < d.context_lens[:, None])[:, None]
        rows = slice(None) if d.rows is None else d.rows  # (the step's first rows, in order)
        yield rows, None, torch.arange(tables.shape[0], device=tables.device)[:, None], tables, visible
    for c in meta.chunks:
        yield c.rows, c.picks, c.index, c.block_tables, c.mask[:, 0]


class GlmMoeDsaForCausalLM(MoeCausalLM):
    prompts_from_cache = True
    check = staticmethod(check)

    @classmethod
    def cache_shapes(cls, config: PretrainedConfig) -> list[tuple[int, ...]]:
        """Per token and layer: the latent and rotated shared key, and the indexer's key."""
        return [(1, config.kv_lora_rank + config.qk_rope_head_dim), (1, config.index_head_dim)]

    def attention(self, config: PretrainedConfig, index: int) -> nn.Module:
        return LatentAttention(config, has_indexer(config, index))

    def mlp(self, config: PretrainedConfig, index: int) -> nn.Module:
        if is_sparse(config, index):
            return glm_moe_block(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)
