"""Sequence packing: many variable-length samples share fixed rows of `seq_len` tokens.

Every sample keeps its own position ids (0, 1, 2, … restarting at each sample). Hugging Face
decoders given `position_ids` and no attention mask (and no cache) derive a block-diagonal
causal mask from where the positions restart, so packed samples never attend to each other.
Padding at the end of a row is one more segment of its own whose tokens carry no loss.

The loss mask is aligned with the tokens: `loss_mask[i]` says whether token i is a target
(predicted from tokens < i of its own sample). A sample's first token is never a target, which
is also what makes the shifted loss safe across the boundary between two packed samples.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sample:
    """One training sequence: token ids and which of them are loss targets."""

    input_ids: list[int]
    loss_mask: list[bool]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"{len(self.input_ids)} token ids but {len(self.loss_mask)} mask entries")
        if not self.input_ids:
            raise ValueError("empty sample")

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask[1:])


@dataclass
class MicroBatch:
    """Packed rows ready for a forward pass: tensors of shape [rows, seq_len]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(*(t.to(device, non_blocking=True) for t in vars(self).values()))

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def pack_rows(samples: list[Sample], seq_len: int) -> list[list[Sample]]:
    """First-fit packing in order: each sample goes into the first row with room for it."""
    rows: list[list[Sample]] = []
    free: list[int] = []
    for sample in samples:
        if len(sample.input_ids) > seq_len:
            raise ValueError(f"a sample of {len(sample.input_ids)} tokens does not fit seq_len {seq_len}")
        for i, room in enumerate(free):
            if len(sample.input_ids) <= room:
                rows[i].append(sample)
                free[i] -= len(sample.input_ids)
                break
        else:
            rows.append([sample])
            free.append(seq_len - len(sample.input_ids))
    return rows


def row_tensors(row: list[Sample], seq_len: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """Concatenate one row's samples and pad it to `seq_len`; returns (ids, positions, mask)."""
    ids: list[int] = []
    positions: list[int] = []
    mask: list[bool] = []
    for sample in row:
        ids += sample.input_ids
        positions += range(len(sample.input_ids))
        mask += [False] + list(sample.loss_mask[1:])
    pad = seq_len - len(ids)
    ids += [pad_id] * pad
    positions += range(pad)
    mask += [False] * pad
    return torch.tensor(ids), torch.tensor(positions), torch.tensor(mask)


def make_micro_batches(
    rows: list[list[Sample]], seq_len: int, pad_id: int, micro_batch_size: int, num_micro_batches: int
) -> list[MicroBatch]:
    """Spread rows evenly over `num_micro_batches` micro-batches of at most `micro_batch_size` rows.

    Under FSDP every rank must run the same number of forward/backward passes, so a rank with
    too few rows runs micro-batches of a single padding row (no loss tokens). Partly filled
    micro-batches are not padded with whole rows: that would only burn compute.
    """
    if len(rows) > micro_batch_size * num_micro_batches:
        raise ValueError(f"{len(rows)} rows do not fit {num_micro_batches} × {micro_batch_size}")
    tensors = [row_tensors(row, seq_len, pad_id) for row in rows]
    base, extra = divmod(len(tensors), num_micro_batches)
    batches, start = [], 0
    for i in range(num_micro_batches):
        chunk = tensors[start : start + base + (i < extra)] or [row_tensors([], seq_len, pad_id)]
        start += base + (i < extra)
        batches.append(MicroBatch(*(torch.stack(parts) for parts in zip(*chunk, strict=True))))
    return batches


def shard_rows(
    rows: list[list[Sample]], rank: int, world_size: int, micro_batch_size: int
) -> tuple[list[list[Sample]], int]:
    """This rank's rows (round robin) and the micro-batch count every rank must run."""
    rows_per_rank = math.ceil(len(rows) / world_size)
    return rows[rank::world_size], max(1, math.ceil(rows_per_rank / micro_batch_size))
