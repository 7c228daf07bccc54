"""Paged KV-cache bookkeeping: fixed-size blocks, reference-counted so samples can share them.

The n samples of one prompt share the prompt's full blocks. At the fork, the partly filled last
block (if any) is copied for each new sample, so every block a sequence writes into is its own
and no later copy-on-write is needed. Block 0 is never handed out: padded rows of a batch write
their keys and values there.

Besides each sequence's `block_table` list, the block tables live in one persistent array (a
row per sequence holding blocks, kept up to date as blocks are added), so a step's batch of
tables is one fancy-indexing copy instead of a Python loop over sequences.
"""

import numpy as np

from tandem.inference.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        # a column per block a sequence can hold (the context length caps it); rows grow on demand
        width = min(max_blocks_per_seq or num_blocks - 1, num_blocks - 1)
        self.tables = np.zeros((64, width), dtype=np.int64)
        self.free_rows = list(range(63, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold its first `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` tokens; False (nothing taken) if too few are free."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed == 0:
            return True
        if needed > len(self.free_blocks):
            return False
        start = len(seq.block_table)
        new = [self.free_blocks.pop() for _ in range(needed)]
        for block in new:
            self.ref_counts[block] = 1
        seq.block_table += new
        self._write(seq, start)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share `parent`'s full blocks with `child`; copy the partly filled last block.

        Returns the (source, destination) block pair the cache must copy, or None. The caller
        checks `can_fork` first.
        """
        full = parent.num_cached // self.block_size
        shared = parent.block_table[:full]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        child.num_cached = parent.num_cached
        pair = None
        if len(parent.block_table) > full:
            block = self.free_blocks.pop()
            self.ref_counts[block] = 1
            child.block_table.append(block)
            pair = parent.block_table[full], block
        self._write(child, 0)
        return pair

    def can_fork(self, parent: Sequence, count: int) -> bool:
        partial = len(parent.block_table) > parent.num_cached // self.block_size
        return not partial or len(self.free_blocks) >= count

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        if seq.table_row >= 0:
            self.tables[seq.table_row, : len(seq.block_table)] = 0
            self.free_rows.append(seq.table_row)
            seq.table_row = -1
        seq.block_table = []
        seq.num_cached = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _write(self, seq: Sequence, start: int) -> None:
        """Copy `seq.block_table[start:]` into its row of `tables` (a row is assigned on first use)."""
        if seq.table_row < 0:
            if not self.free_rows:
                rows = len(self.tables)
                self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
                self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
            seq.table_row = self.free_rows.pop()
        self.tables[seq.table_row, start : len(seq.block_table)] = seq.block_table[start:]
