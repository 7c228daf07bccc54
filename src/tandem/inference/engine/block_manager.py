"""Paged KV-cache bookkeeping: fixed-size blocks, reference-counted so samples can share them.

The n samples of one prompt share the prompt's full blocks. At the fork, the partly filled last
block (if any) is copied for each new sample, so every block a sequence writes into is its own
and no later copy-on-write is needed. Block 0 is never handed out: padded rows of a batch write
their keys and values there.
"""

from tandem.inference.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first

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
        if needed > len(self.free_blocks):
            return False
        for _ in range(needed):
            block = self.free_blocks.pop()
            self.ref_counts[block] = 1
            seq.block_table.append(block)
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
        if len(parent.block_table) > full:
            block = self.free_blocks.pop()
            self.ref_counts[block] = 1
            child.block_table.append(block)
            return parent.block_table[full], block
        return None

    def can_fork(self, parent: Sequence, count: int) -> bool:
        partial = len(parent.block_table) > parent.num_cached // self.block_size
        return not partial or len(self.free_blocks) >= count

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
        seq.num_cached = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
