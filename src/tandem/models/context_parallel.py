"""Context parallelism: every packed row of a micro-batch is split along the sequence over the N
ranks of a cp group.

All ranks of a group are given the same micro-batch (the whole rows); each embeds, normalises,
runs the MLP/MoE and the output head on its own columns only, so activations and the head's
logits shrink N-fold. Rows are first padded to a multiple of `width_multiple` (padding is one more
document with no loss). Attention is the one place that needs other ranks' tokens:

- `ulysses`: rank r holds the r-th contiguous W/N columns. Around attention one all-to-all
  turns q, k, v from [rows, W/N, heads, d] (sequence-sharded, every head) into
  [rows, W, heads/N, d] (the whole row, 1/N of the heads); attention then runs exactly as without
  CP on whole rows, and a second all-to-all turns the output back. Needs heads % N = 0; with
  fewer KV heads than N each KV head is repeated N / kv_heads times first, so every rank gets
  the one its query heads read (kv_heads must divide N or be a multiple of it).
- `ring`: the row is cut into 2N chunks and rank r holds chunks r and 2N−1−r (zigzag), so the
  causal work is balanced: chunk i's queries see i + 1 chunks, a rank's two chunks 2N + 1
  together. Keys and values are all-gathered around the group (one collective per layer; in
  backward their gradients are summed back to their owners by an all-to-all) and each rank's
  queries attend to the whole row, masked by document and global column (layers/attention.py
  `query_columns`). Any head counts. (This gathers K/V rather than passing blocks from rank to
  rank with an online softmax, as Llama 3's context parallelism does: the same arithmetic, one
  collective instead of N − 1, and each layer holds the row's K/V, kv_heads · d wide, once.)

Multi-head latent attention (GLM-5) gathers in either style: its heads share one compressed key
per token (kv_lora_rank + rope channels, layers/mla.py), so there are no KV heads to split; each
rank gathers those and the indexer's keys over the whole row and its queries choose and attend
among them by global column (`TokenDocuments`, layers/dsa.py). The style then only sets which
columns a rank holds: ring's zigzag balances the causal work, Ulysses' contiguous columns do not.

Documents may cross rank boundaries: document boundaries come from the whole rows' position ids,
which every rank has, and each column keeps its own position id (for RoPE).

Next-token alignment: the hidden state at column c predicts the token at c + 1. The shard's
predictions are therefore matched with the tokens one column to the right (`tokens`), which
every per-token tensor of the loss (loss mask, sampler logprobs, advantages) goes through; the
last column predicts nothing (its token-aligned entries are 0 / False).

Gradients: each rank's loss covers its own tokens, and the collectives' backward sends each
rank the gradient of the activations it owns, so the sum over a group's ranks is the gradient
of the whole micro-batch's loss, as FSDP's reduction over all ranks expects (parallelism.py).
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem.config.base import CPStyle, cp_width_multiple
from tandem.models.expert_parallel import all_to_all
from tandem.models.layers.attention import PackedDocs
from tandem.models.layers.dsa import TokenDocuments
from tandem.models.layers.mla import LatentAttention
from tandem.models.layers.transformer import Attention


def check_heads(num_heads: int, num_kv_heads: int, cp: int, style: CPStyle) -> None:
    """ValueError, in one line, when `style` cannot split these heads over `cp` ranks."""
    if style != "ulysses":
        return
    if num_heads % cp:
        raise ValueError(
            f"trainer.parallel.cp = {cp} with cp_style = 'ulysses' needs the {num_heads} query heads to "
            f"be a multiple of cp (use cp_style = 'ring', or a cp that divides {num_heads})"
        )
    if num_kv_heads % cp and cp % num_kv_heads:
        raise ValueError(
            f"trainer.parallel.cp = {cp} with cp_style = 'ulysses' needs the {num_kv_heads} KV heads to be "
            f"a multiple or a divisor of cp (use cp_style = 'ring')"
        )


class _GatherColumns(torch.autograd.Function):
    """[rows, L, ...] on each rank → [N, rows, L, ...] of every rank; backward sums each rank's
    part of the gradient, from every rank, back to that rank."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # (empty_like keeps a non-contiguous layout; the collectives fill memory in order)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received.sum(0), None


@torch.compiler.disable
def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[rows, L, H, d], this rank's columns → [rows, N·L, H/N, d], every column, this rank's heads."""
    n = dist.get_world_size(group)
    rows, length, heads, dim = x.shape
    blocks = (
        x.view(rows, length, n, heads // n, dim).permute(2, 0, 1, 3, 4).reshape(n * rows, length, -1, dim)
    )
    received = all_to_all(blocks, [rows] * n, [rows] * n, group)
    return received.view(n, rows, length, -1, dim).permute(1, 0, 2, 3, 4).reshape(rows, n * length, -1, dim)


@torch.compiler.disable
def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `sequence_to_heads`."""
    n = dist.get_world_size(group)
    rows, width, heads, dim = x.shape
    length = width // n
    blocks = x.view(rows, n, length, heads, dim).permute(1, 0, 2, 3, 4).reshape(n * rows, length, heads, dim)
    received = all_to_all(blocks, [rows] * n, [rows] * n, group)
    return (
        received.view(n, rows, length, heads, dim)
        .permute(1, 2, 0, 3, 4)
        .reshape(rows, length, n * heads, dim)
    )


@torch.compiler.disable
def gather_columns(x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """[rows, L, ...] of this rank's columns → [rows, W, ...] of the whole row; `order` puts the
    ranks' columns, concatenated in rank order, back in column order."""
    gathered = _GatherColumns.apply(x, group)
    n, rows, length = gathered.shape[:3]
    whole = gathered.transpose(0, 1).reshape(rows, n * length, *x.shape[2:])
    return whole.index_select(1, order)


@dataclass
class UlyssesDocs:
    """Attention over whole rows on this rank's heads, between two all-to-alls."""

    docs: PackedDocs  # of the whole (padded) rows
    group: dist.ProcessGroup
    size: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        heads, kv_heads = q.shape[2], k.shape[2]
        if kv_heads < self.size:  # replicate: rank r's query heads all read KV head r·kv_heads/N
            k, v = (t.repeat_interleave(self.size // kv_heads, dim=2) for t in (k, v))
            kv_heads = self.size
        # one all-to-all for q, k and v: each rank's block is its heads of all three
        rows, length, n = q.shape[0], q.shape[1], self.size
        parts = [t.reshape(rows, length, n, -1, t.shape[3]) for t in (q, k, v)]
        qkv = sequence_to_heads(torch.cat(parts, dim=3).flatten(2, 3), self.group)
        q, k, v = qkv.split([heads // n, kv_heads // n, kv_heads // n], dim=2)
        return heads_to_sequence(self.docs.attend(q, k, v, scale), self.group)


@dataclass
class RingDocs:
    """This rank's queries against the whole row's keys and values, gathered from the group."""

    docs: PackedDocs  # this rank's query columns against the whole (padded) rows
    group: dist.ProcessGroup
    order: torch.Tensor  # the ranks' columns, concatenated in rank order → column order

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = gather_columns(torch.cat([k, v], dim=2), self.group, self.order).chunk(2, dim=2)
        return self.docs.attend(q, k, v, scale)


class ContextParallel:
    """This rank's place in its cp group, and how a micro-batch's rows are split over the group.

    `latent`: the model's attention is multi-head latent attention (GLM-5), which gathers its
    compressed keys over the whole row in either style (layers/mla.py); the style then only sets
    which columns a rank holds."""

    def __init__(self, group: dist.ProcessGroup, style: CPStyle, latent: bool = False) -> None:
        self.group, self.style, self.latent = group, style, latent
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.width_multiple = cp_width_multiple(self.size, style)

    def padded_width(self, width: int) -> int:
        return -(-width // self.width_multiple) * self.width_multiple

    def columns(self, width: int, device: torch.device, rank: int | None = None) -> torch.Tensor:
        """The columns of a row of (padded) `width` that `rank` (default: this one) holds, ascending."""
        rank = self.rank if rank is None else rank
        if self.style == "ulysses":
            chunk = width // self.size
            return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        chunk, mirror = width // (2 * self.size), 2 * self.size - 1 - rank
        return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in (rank, mirror)])

    def shard(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor, UlyssesDocs | RingDocs | TokenDocuments]:
        """This rank's token ids and position ids [rows, W/N] of the whole rows, and the attention
        layout every layer uses."""
        rows, width = input_ids.shape
        padded = self.padded_width(width)
        pad = padded - width
        device = input_ids.device
        input_ids = torch.cat([input_ids, input_ids.new_zeros(rows, pad)], dim=1)
        padding_positions = torch.arange(pad, device=device).expand(rows, pad)
        position_ids = torch.cat([position_ids, padding_positions.to(position_ids.dtype)], dim=1)
        mine = self.columns(padded, device)
        if self.latent:
            gather = functools.partial(gather_columns, group=self.group, order=self._order(padded, device))
            docs = TokenDocuments.from_positions(position_ids, mine, gather)
        elif self.style == "ulysses":
            docs = UlyssesDocs(PackedDocs.from_positions(position_ids, backend), self.group, self.size)
        else:
            docs = RingDocs(
                PackedDocs.from_positions(position_ids, backend, mine),
                self.group,
                self._order(padded, device),
            )
        return input_ids[:, mine], position_ids[:, mine], docs

    def _order(self, width: int, device: torch.device) -> torch.Tensor:
        """The ranks' columns, concatenated in rank order → column order."""
        return torch.cat([self.columns(width, device, r) for r in range(self.size)]).argsort()

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        """The entries of a token-aligned tensor [rows, W] (loss mask, input ids...) that this rank's
        predictions are for: those one column right of its columns (0 / False past the end)."""
        rows, width = t.shape
        padded = self.padded_width(width)
        shifted = torch.cat([t[:, 1:], t.new_zeros(rows, padded - width + 1)], dim=1)
        return shifted[:, self.columns(padded, t.device)]


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, style: CPStyle) -> None:
    """Split the model's rows over `group` (checking first that `style` can split its heads)."""
    cp = dist.get_world_size(group)
    for attention in (m for m in model.modules() if isinstance(m, Attention)):
        check_heads(attention.num_heads, attention.num_kv_heads, cp, style)
    latent = any(isinstance(m, LatentAttention) for m in model.modules())
    model.context_parallel = ContextParallel(group, style, latent)


def token_view(model: nn.Module):  # noqa: ANN201 (Callable[[Tensor], Tensor])
    """How the trainers take their per-token tensors to match `model.sequence_logprobs`: this
    rank's entries under context parallelism, else the tensors as they are."""
    cp = getattr(model, "context_parallel", None)
    return (lambda t: t) if cp is None else cp.tokens
