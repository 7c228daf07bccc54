"""DeepSeek sparse attention (GLM-5): a lightning indexer picks, per query, the `topk` keys of its
document it may attend to; attention then reads only those.

Indexer, per query token t and key token s of the same document, s ≤ t (H index heads of D):

    q = rotary(wq · q_resid_t)  [H, D],   k = rotary(LayerNorm(wk · x_s))  [D],   w = weights_proj · x_t  [H]
    score(t, s) = Σ_h  w_h · H^-½ · relu(q_h · k · D^-½)

and the top `index_topk` keys by score are kept (all of them when the document is shorter).
As in transformers' reference the indexer runs without gradient: it is not trained, its
weights stay those of the checkpoint. Scores are formed a chunk of queries at a time, so the
indexer holds [rows, chunk, H, width] at once, never [rows, width, width] per head.

Where no document is longer than `topk`, the indexer would choose every key a query may see:
with `sparse_attention = "long_documents"` (the model's `dense_short_documents`) such micro-batches
skip the indexers and attend through the packed backend instead (`TokenDocuments.packed`), which is
exact. Otherwise, two ways to attend to the chosen keys, equal up to rounding:

- dense (`TokenDocuments.visible` & chosen as one boolean mask and one SDPA call over the
  expanded keys: O(width²) memory; any device, the reference path);
- sparse (`sparse_latent_attention`): per chunk of queries, gather the chosen keys' compressed
  latents and attend in MLA's absorbed form (below); each chunk is recomputed in backward, so
  memory is O(width · topk) for the indices plus one chunk's gather, not O(width²).

Absorbed MLA: with W_UK, W_UV the per-head key and value up-projections of the latent c,
q_nope · (W_UK c) = (W_UKᵀ q_nope) · c and Σ p·(W_UV c) = W_UV (Σ p·c), so keys and values
never leave the latent space (kv_lora_rank + rope channels per token, shared by all heads).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.models.layers.attention import PackedDocs
from tandem.models.layers.rotary import apply_rotary_interleaved

INDEX_CHUNK_ELEMENTS = 1 << 26  # at most this many fp32 scores [rows, chunk, heads, width] at once
SPARSE_CHUNK_ELEMENTS = 1 << 28  # at most this many gathered latent channels [rows, chunk, topk, dim]


@dataclass
class TokenDocuments:
    """Which document each token of a packed batch belongs to, and which tokens are this rank's
    queries.

    doc_ids [rows, width] covers the whole rows (every key). Under context parallelism
    (models/context_parallel.py) a rank's queries are only `query_columns` of each row (global
    column indices, ascending) and `gather` turns a tensor of its columns [rows, queries, ...]
    into the whole rows' [rows, width, ...] (gradients flow back to each column's rank); without
    it the queries are every column and `gather` is None.
    """

    doc_ids: torch.Tensor
    position_ids: torch.Tensor  # [rows, width]: each column's position in its document
    query_columns: torch.Tensor | None = None
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # set when no document is longer than the indexers' top-k (`with_packed`): attention then
    # reads every visible key through the packed backend, and no indexer runs
    packed: PackedDocs | None = None

    @classmethod
    def from_positions(
        cls,
        position_ids: torch.Tensor,
        query_columns: torch.Tensor | None = None,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> "TokenDocuments":
        """From the whole rows' position ids (a document starts where they restart at 0)."""
        starts = position_ids == 0
        starts[:, 0] = True  # a row always begins a document
        return cls(starts.cumsum(dim=1), position_ids, query_columns, gather)

    def with_packed(self, backend: str) -> "TokenDocuments":
        """The same documents, attended through `backend`'s packed attention (layers/attention.py)."""
        packed = PackedDocs.from_positions(self.position_ids, backend, self.query_columns)
        return dataclasses.replace(self, packed=packed)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of x [rows, queries, ...] → the whole rows' [rows, width, ...]."""
        return x if self.gather is None else self.gather(x)

    def _queries(self, start: int, end: int) -> torch.Tensor:
        """The global columns of this rank's queries start…end."""
        if self.query_columns is None:
            return torch.arange(start, end, device=self.doc_ids.device)
        return self.query_columns[start:end]

    def visible(self, start: int, end: int) -> torch.Tensor:
        """[rows, end - start, width]: query start + i may see key j (same document, j ≤ its column)."""
        width = self.doc_ids.shape[1]
        query = self._queries(start, end)
        causal = torch.arange(width, device=self.doc_ids.device)[None, :] <= query[:, None]
        return (self.doc_ids[:, query, None] == self.doc_ids[:, None, :]) & causal

    def visible_chosen(self, chosen: torch.Tensor, start: int) -> torch.Tensor:
        """chosen key columns [rows, C, k] of the queries start…start + C → whether each is visible."""
        rows, count, k = chosen.shape
        query = self._queries(start, start + count)
        key_doc = self.doc_ids.gather(1, chosen.reshape(rows, count * k)).view(rows, count, k)
        return (key_doc == self.doc_ids[:, query, None]) & (chosen <= query[None, :, None])


def chunk_size(elements_per_query: int, budget: int) -> int:
    return max(1, budget // max(1, elements_per_query))


class Indexer(nn.Module):
    """The lightning indexer of one layer (see the module docstring); frozen."""

    def __init__(
        self, dim: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int, topk: int
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope_dim, self.topk = heads, head_dim, rope_dim, topk
        self.wq = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(dim, heads, bias=False)
        self.requires_grad_(False)
        self.chunk_elements = INDEX_CHUNK_ELEMENTS

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: TokenDocuments,
    ) -> torch.Tensor:
        """x [rows, queries, dim], q_resid [rows, queries, q_lora_rank] of this rank's columns →
        chosen key columns [rows, queries, k] of the whole rows, k = min(topk, width); a query
        with fewer visible keys than k also gets invisible ones, which attention masks."""
        rows, queries, _ = x.shape
        width = docs.doc_ids.shape[1]
        q = self.wq(q_resid).view(rows, queries, self.heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, :, None]
        q = self._rotate(q, cos, sin).float()
        k = docs.whole(self._rotate(k, cos, sin)[:, :, 0].float())
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads**-0.5
        keys = k.transpose(-1, -2)[:, None]  # [rows, 1, D, width]
        count = min(self.topk, width)
        chosen = []
        step = chunk_size(rows * self.heads * width, self.chunk_elements)
        for start in range(0, queries, step):
            end = min(start + step, queries)
            scores = F.relu(torch.matmul(q[:, start:end], keys) * self.head_dim**-0.5)  # [rows, C, H, width]
            index = torch.matmul(weights[:, start:end, None], scores).squeeze(-2)  # [rows, C, width]
            index = index.masked_fill(~docs.visible(start, end), float("-inf"))
            chosen.append(index.topk(count, dim=-1).indices)
        return torch.cat(chosen, dim=1)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary_interleaved(rot, cos, sin), rest], dim=-1)


def chosen_mask(chosen: torch.Tensor, width: int) -> torch.Tensor:
    """Key indices [rows, width, k] → bool [rows, width, width], True at the chosen keys."""
    mask = torch.zeros(*chosen.shape[:2], width, dtype=torch.bool, device=chosen.device)
    return mask.scatter_(-1, chosen, True)


def sparse_latent_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    keys: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    chosen: torch.Tensor,
    docs: TokenDocuments,
    scale: float,
    chunk_elements: int = SPARSE_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Attention of each query over its chosen keys, in the latent space (module docstring).

    q_nope [rows, queries, H, n], q_rope [rows, queries, H, r] (rotated), keys [rows, width, L + r]
    (each key's normed latent and rotated k_rope, of the whole rows), w_uk [H, n, L], w_uv [H, v, L],
    chosen [rows, queries, k] → [rows, queries, H, v].
    """
    rows, queries = q_nope.shape[:2]
    k = chosen.shape[-1]
    rank = w_uk.shape[-1]
    step = chunk_size(rows * k * keys.shape[-1], chunk_elements)
    q_latent = torch.einsum("bshn,hnl->bshl", q_nope, w_uk)
    latent_queries = torch.cat([q_latent, q_rope], dim=-1)  # [rows, queries, H, L + r]
    outs = []
    for start in range(0, queries, step):
        end = min(start + step, queries)
        visible = docs.visible_chosen(chosen[:, start:end], start)
        outs.append(
            checkpoint(
                _chunk_attention,
                latent_queries[:, start:end],
                keys,
                chosen[:, start:end],
                visible,
                rank,
                scale,
                use_reentrant=False,
            )  # fmt: skip
        )
    return torch.einsum("bshl,hvl->bshv", torch.cat(outs, dim=1), w_uv)


def _chunk_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    chosen: torch.Tensor,
    visible: torch.Tensor,
    rank: int,
    scale: float,
) -> torch.Tensor:
    """One chunk of queries [rows, C, H, L + r] over its chosen keys → latent outputs [rows, C, H, L]."""
    rows, count, k = chosen.shape
    picked = keys.gather(1, chosen.reshape(rows, count * k, 1).expand(-1, -1, keys.shape[-1]))
    picked = picked.view(rows, count, k, keys.shape[-1])
    heads, dim = queries.shape[-2:]
    scores = fp32_scores(queries.reshape(rows * count, heads, dim), picked.view(rows * count, k, dim))
    scores = scores.view(rows, count, heads, k) * scale
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = scores.softmax(-1).to(queries.dtype)
    return torch.einsum("bchk,bckl->bchl", probs, picked[..., :rank])


def fp32_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries [B, H, D] · keys [B, k, D]ᵀ → float32 [B, H, k], not rounded to the inputs' dtype
    before the softmax (as the fused attention kernels keep their scores): on CUDA bf16/fp16
    inputs stay on the tensor cores with an fp32 output (`_Fp32Scores`); elsewhere the inputs are
    widened, which is exact."""
    if queries.dtype == torch.float32:
        return torch.bmm(queries, keys.transpose(1, 2))
    if queries.is_cuda:
        return _Fp32Scores.apply(queries, keys)
    return torch.bmm(queries.float(), keys.float().transpose(1, 2))


class _Fp32Scores(torch.autograd.Function):
    """`torch.bmm(..., out_dtype=torch.float32)` (CUDA only, no derivative in torch) with its
    backward: the scores' gradient is rounded to the inputs' dtype, as a bf16 matmul's is."""

    @staticmethod
    def forward(ctx, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(queries, keys)
        return torch.bmm(queries, keys.transpose(1, 2), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        queries, keys = ctx.saved_tensors
        grad = grad.to(queries.dtype)
        return torch.bmm(grad, keys), torch.bmm(grad.transpose(1, 2), queries)
