"""Paged KV-cache bookkeeping: fixed-size blocks, reference-counted so samples can share them.

The n samples of one prompt share the prompt's full blocks. At the fork, the partly filled last
block (if any) is copied for each new sample, so every block a sequence writes into is its own
and no later copy-on-write is needed. Block 0 is never handed out: padded rows of a batch write
their keys and values there.

Prefix cache: every full block whose keys and values are computed (or are being computed by
the step being launched) is registered under a hash of all tokens up to its end (chained block
by block). A new sequence starts from the longest
run of registered blocks that match its prompt, so a multi-turn conversation re-sent with one
more turn, or a prompt repeated by another request, computes only its new tokens. A block
whose last user is gone stays registered and reusable until it is needed for new tokens; the
least recently released goes first, after the blocks that hold nothing reusable. Loading new
weights makes every registered block stale: `reset_prefix_cache` forgets them all, and a
sequence that started before cannot register blocks after (its keys mix two weight versions).

Blocks computed by another engine (prefill on other servers: kv_prefix.py) enter through
`adopt`: taken like blocks for new tokens, registered under the same chained hashes, and released
at once, so a request admitted next finds them as it finds its own.

Besides each sequence's `block_table` list, the block tables live in one persistent array (a
row per sequence holding blocks, kept up to date as blocks are added), so a step's batch of
tables is one fancy-indexing copy instead of a Python loop over sequences.
"""

from collections import OrderedDict

import numpy as np

from tandem.inference.engine.sequence import PLACEHOLDER, Sequence


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt of `num_tokens` that a prefix-cache hit can skip (the last token
    is always computed)."""
    return max(0, (num_tokens - 1) // block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int | None = None,
        prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        # prefix cache: hash -> block, block -> (hash, its tokens), released registered blocks (LRU)
        self.prefix_caching = prefix_caching
        self.cached: dict[int, int] = {}
        self.block_keys: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.epoch = 0  # bumped by reset_prefix_cache
        self.hit_tokens_total = 0  # prompt tokens not computed thanks to the cache (scheduler.py)
        # a column per block a sequence can hold (the context length caps it); rows grow on demand
        width = min(max_blocks_per_seq or num_blocks - 1, num_blocks - 1)
        self.tables = np.zeros((64, width), dtype=np.int64)
        self.free_rows = list(range(63, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

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
        if needed > self.num_free:
            return False
        if not seq.block_table:
            seq.cache_epoch = self.epoch
        start = len(seq.block_table)
        seq.block_table += [self._take() for _ in range(needed)]
        self._write(seq, start)
        return True

    def _take(self) -> int:
        """A block for new tokens: one holding nothing reusable, else the least recently released."""
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_keys.pop(block)[0]]
        self.ref_counts[block] = 1
        return block

    # ---- prefix cache --------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Start a sequence that holds no blocks from the registered blocks matching its tokens
        (at least one token is left to compute); returns the tokens it need not compute."""
        if not self.cached or seq.block_table:  # (nothing is registered without prefix_caching)
            return 0
        seq.cache_epoch = self.epoch
        found = self.lookup(seq.token_ids, reusable_blocks(seq.num_tokens, self.block_size))
        for block in found:
            self._pin(block)
        if found:
            seq.block_table = found
            seq.num_hashed = len(found)
            seq.num_cached = seq.num_hashed * self.block_size
            seq.prefix_hash = self.block_keys[found[-1]][0]
            self._write(seq, 0)
        return seq.num_cached

    def register(self, seq: Sequence, num_tokens: int) -> None:
        """Register `seq`'s full blocks among its first `num_tokens` tokens (whose keys and values
        are computed, or are being computed in the step being launched) while their tokens are known."""
        if not self.prefix_caching or seq.cache_epoch != self.epoch:
            return  # (a sequence whose keys and values predate the current weights registers nothing)
        while (seq.num_hashed + 1) * self.block_size <= num_tokens and self._register_next(seq):
            pass

    def _register_next(self, seq: Sequence) -> bool:
        """Register `seq`'s next full block; False while one of its tokens is still on its way."""
        i, size = seq.num_hashed, self.block_size
        tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
        if PLACEHOLDER in tokens:
            return False
        key = hash((seq.prefix_hash, tokens))
        block = seq.block_table[i]
        if key not in self.cached and block not in self.block_keys:
            self.cached[key] = block
            self.block_keys[block] = (key, tokens)
        seq.prefix_hash = key
        seq.num_hashed += 1
        return True

    def lookup(self, token_ids: list[int], num_blocks: int) -> list[int]:
        """The registered blocks holding the first (up to) `num_blocks` full blocks of `token_ids`,
        in order, as far as the chain of registered blocks reaches; nothing is taken or pinned."""
        found: list[int] = []
        parent = None
        size = self.block_size
        for i in range(num_blocks):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            key = hash((parent, tokens))
            block = self.cached.get(key)
            if block is None or self.block_keys[block][1] != tokens:
                break
            found.append(block)
            parent = key
        return found

    def adopt(self, token_ids: list[int], first: int, num_blocks: int) -> list[tuple[int, int]]:
        """Register the first `num_blocks` full blocks of `token_ids` as cached, where blocks
        `first`… come with their keys and values from elsewhere (kv_prefix.py) and the ones before
        must be registered here already. Returns (i, block) for each block i whose keys and values
        the caller must write into `block` now, before any step runs: those not registered yet.
        Stops where the chain breaks (a block before `first` gone) or no block is free; the
        adopted blocks are released at once, so they stay reusable until evicted like any other."""
        if not self.prefix_caching:
            return []
        size, parent = self.block_size, None
        held: list[int] = []  # pinned while adopting, so that taking a block cannot evict them
        to_write: list[tuple[int, int]] = []
        try:
            for i in range(num_blocks):
                tokens = tuple(token_ids[i * size : (i + 1) * size])
                key = hash((parent, tokens))
                block = self.cached.get(key)
                if block is not None and self.block_keys[block][1] == tokens:
                    self._pin(block)
                elif block is not None or i < first or not self.num_free:
                    break  # (another prefix under this hash; a block we do not have; no room)
                else:
                    block = self._take()
                    self.cached[key] = block
                    self.block_keys[block] = (key, tokens)
                    to_write.append((i, block))
                held.append(block)
                parent = key
        finally:
            for block in held:
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self.evictable[block] = None
        return to_write

    def _pin(self, block: int) -> None:
        """One more user of a registered block (no longer evictable)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (new weights make their keys and values stale)."""
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.block_keys.clear()
        self.epoch += 1

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
        child.cache_epoch = parent.cache_epoch
        child.num_hashed, child.prefix_hash = parent.num_hashed, parent.prefix_hash
        pair = None
        if len(parent.block_table) > full:
            block = self._take()
            child.block_table.append(block)
            pair = parent.block_table[full], block
        self._write(child, 0)
        return pair

    def can_fork(self, parent: Sequence, count: int) -> bool:
        partial = len(parent.block_table) > parent.num_cached // self.block_size
        return not partial or self.num_free >= count

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.block_keys:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        if seq.table_row >= 0:
            self.tables[seq.table_row, : len(seq.block_table)] = 0
            self.free_rows.append(seq.table_row)
            seq.table_row = -1
        seq.block_table = []
        seq.num_cached = seq.num_hashed = 0
        seq.prefix_hash = None

    def _write(self, seq: Sequence, start: int) -> None:
        """Copy `seq.block_table[start:]` into its row of `tables` (a row is assigned on first use)."""
        if seq.table_row < 0:
            if not self.free_rows:
                rows = len(self.tables)
                self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
                self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
            seq.table_row = self.free_rows.pop()
        self.tables[seq.table_row, start : len(seq.block_table)] = seq.block_table[start:]
