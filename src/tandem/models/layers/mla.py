"""Multi-head latent attention (DeepSeek-V3 / GLM-5) over packed rows, with the sparse-attention
indexer of layers/dsa.py.

Per token x (H heads; n, r, v the nope, rope and value widths; L = kv_lora_rank):

    q_resid = RMSNorm(Wq_a x)                         (q_lora_rank)
    q = Wq_b q_resid → per head [q_nope (n) | q_rope (r)]
    [c | k_rope] = Wkv_a x,   c = RMSNorm(c)          (L + r: the compressed KV, shared by all heads)
    k = [W_UK c (per head, n) | k_rope],   v = W_UV c (per head, v)      (W_UK, W_UV: rows of Wkv_b)
    q_rope, k_rope rotated (interleaved pairs);   out = Wo · attention(q, k, v)

Wq_a and Wkv_a read the same input and run as one matmul (`wq_kv_a`). Attention is restricted
to the keys the indexer chose (a "full" layer runs its own indexer, a "shared" one reuses the
previous full layer's choice), densely or sparsely (layers/dsa.py); scores are scaled by
`scale` (1/√(n + r), times YaRN's mscale² when the checkpoint says so).

Under context parallelism a rank computes its own columns' queries and [c | k_rope] and gathers
the latter over the whole row (`TokenDocuments.whole`): L + r channels per token, whatever the
cp style, since every head reads them and they cannot be split by head as Ulysses splits
grouped-query attention. The indexer gathers its keys the same way.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers.attention import PackedDocs
from tandem.models.layers.dsa import (
    SPARSE_CHUNK_ELEMENTS,
    Indexer,
    TokenDocuments,
    chosen_mask,
    sparse_latent_attention,
)
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import apply_rotary_interleaved
from tandem.models.lora import LoRALinear

LORA_NORM_EPS = 1e-6  # the q and kv latent norms' epsilon in the reference (not the config's)


class LatentAttention(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        bias: bool,
        indexer: Indexer | None,
        sparse: bool,
    ) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.rope_dim, self.v_dim = num_heads, nope_dim, rope_dim, v_dim
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.scale = scale
        self.sparse = sparse
        self.sparse_chunk_elements = SPARSE_CHUNK_ELEMENTS
        self.wq_kv_a = nn.Linear(dim, q_lora_rank + kv_lora_rank + rope_dim, bias=bias)
        self.q_norm = RMSNorm(q_lora_rank, LORA_NORM_EPS)
        self.wq_b = nn.Linear(q_lora_rank, num_heads * (nope_dim + rope_dim), bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, LORA_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_dim), bias=False)
        self.wo = nn.Linear(num_heads * v_dim, dim, bias=bias)
        self.indexer = indexer

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: TokenDocuments,
        chosen: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, queries, dim] of this rank's columns → (output [rows, queries, dim], the chosen
        key columns [rows, queries, k]); the keys are the whole rows' (`docs.whole`)."""
        rows, queries, _ = x.shape
        q_a, kv_a = self.wq_kv_a(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], dim=-1)
        q_resid = self.q_norm(q_a)
        q = self.wq_b(q_resid).view(rows, queries, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rotary_interleaved(k_rope[:, :, None], cos, sin)[:, :, 0]
        # every head's keys and values come from these L + r channels per token: the one tensor
        # context parallelism gathers
        keys = docs.whole(torch.cat([self.kv_norm(latent), k_rope], dim=-1))
        q_rope = apply_rotary_interleaved(q_rope, cos, sin)
        if docs.packed is not None:  # no document is longer than the indexer's top-k (layers/dsa.py)
            out = self._packed(q_nope, q_rope, keys, docs.packed)
            return self.wo(out.reshape(rows, queries, self.num_heads * self.v_dim)), None
        if self.indexer is not None:
            chosen = self.indexer(x, q_resid, cos, sin, docs)
        elif chosen is None:
            raise ValueError("a layer sharing the indexer's choice needs an earlier layer with an indexer")
        if self.sparse:
            weight = (
                self.wkv_b.effective_weight() if isinstance(self.wkv_b, LoRALinear) else self.wkv_b.weight
            )
            w_uk, w_uv = weight.view(self.num_heads, -1, self.kv_lora_rank).split(
                [self.nope_dim, self.v_dim], dim=1
            )
            out = sparse_latent_attention(
                q_nope, q_rope, keys, w_uk, w_uv, chosen, docs, self.scale, self.sparse_chunk_elements
            )
        else:
            out = self._dense(q_nope, q_rope, keys, chosen, docs)
        return self.wo(out.reshape(rows, queries, self.num_heads * self.v_dim)), chosen

    def _expand(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q [rows, queries, H, n + r], k [rows, width, H, n + r], v [rows, width, H, v]."""
        rows, width, heads = keys.shape[0], keys.shape[1], q_nope.shape[2]
        latent, k_rope = keys.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = self.wkv_b(latent).view(rows, width, heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
        return q, k, v

    def _packed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, keys: torch.Tensor, packed: PackedDocs
    ) -> torch.Tensor:
        """Every visible key, through the model's packed attention backend; v is zero-padded to
        q and k's width where it is narrower (the kernels take one head width)."""
        q, k, v = self._expand(q_nope, q_rope, keys)
        pad = q.shape[-1] - self.v_dim
        if pad < 0:  # (zeros added to q and k change no score)
            q, k = F.pad(q, (0, -pad)), F.pad(k, (0, -pad))
        out = packed.attend(q, k, F.pad(v, (0, max(pad, 0))), self.scale)
        return out[..., : self.v_dim]

    def _dense(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        keys: torch.Tensor,
        chosen: torch.Tensor,
        docs: TokenDocuments,
    ) -> torch.Tensor:
        """Keys and values expanded per head, one SDPA call under visible & chosen."""
        queries, width = q_nope.shape[1], keys.shape[1]
        q, k, v = self._expand(q_nope, q_rope, keys)
        mask = (docs.visible(0, queries) & chosen_mask(chosen, width))[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=self.scale
        )
        return out.transpose(1, 2)
