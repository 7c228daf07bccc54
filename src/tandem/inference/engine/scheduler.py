"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

Every step the running sequences go first (decodes take one token, a partly prefilled prompt
takes the next chunk), then waiting sequences join in arrival order while the token budget,
`max_num_seqs` and free KV blocks allow; a joining sequence first takes the blocks of its
longest cached prefix (block_manager.py) and computes only the rest. A prompt longer than the
remaining budget is prefilled in chunks over several steps, except one that would fit whole in the
next step beside the running sequences while this step already prefills another prompt: it waits
a step instead (split, its second part would attend as a chunk over the cache, and its first
token would still come after the next step). When a running sequence needs a
block and none is free, the newest running sequence is preempted: its blocks are freed and it goes back to the front of the queue
to be recomputed later, so the cache never overflows.
"""

from collections import deque
from dataclasses import dataclass

from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step
    num_preempted: int = 0
    # every sequence computes its one uncached token and draws one token for itself: the decode
    # path (model_runner.py) and the core's per-step shortcuts apply
    all_decodes: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_tokens_total = 0  # prompt tokens computed (recomputation included)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, admit_new: bool = True, preempt: bool = True) -> ScheduledBatch | None:
        """The next batch. With `preempt=False`, None instead of preempting (the caller tries
        again later with preemption allowed)."""
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        seqs, counts = batch.seqs, batch.num_new_tokens
        preempted_before = self.num_preemptions
        capacity = self.blocks.block_size
        running = self.running
        all_decodes = True
        prefill = 0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            cached = seq.num_cached
            uncached = len(seq.token_ids) - cached
            count = uncached if uncached < budget else budget
            # (the common case, a decode within its last block, needs no allocation)
            if len(seq.block_table) * capacity < cached + count and not self._make_room(
                seq, cached + count, preempt
            ):
                if not preempt:
                    return None
                continue  # `seq` itself was preempted
            seqs.append(seq)
            counts.append(count)
            if uncached != 1 or seq.fan_out != 1:
                all_decodes = False
                prefill += count
            elif cached < seq.num_prompt_tokens:  # a prompt's last token
                prefill += 1
            budget -= count
            i += 1
        if admit_new and self.num_preemptions == preempted_before:
            admitted = len(seqs)
            budget = self._admit(batch, budget)
            if len(seqs) > admitted:
                all_decodes = False
                prefill += sum(counts[admitted:])
        batch.num_preempted = self.num_preemptions - preempted_before
        batch.all_decodes = all_decodes
        self.prefill_tokens_total += prefill
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        """Waiting sequences join. A joining prompt's full blocks are registered in the prefix
        cache at once, so a later one in this same batch already shares them: each layer writes
        every token's keys and values before any attention reads the cache. `max_num_seqs`
        bounds the rows a step samples: a running prompt not yet forked counts its fan-out."""
        rows = sum(s.fan_out for s in self.running)
        beside_running = budget  # what a step holds beside this step's running sequences
        admitted = False
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if rows and rows + seq.fan_out > self.max_num_seqs:
                break
            hit = self.blocks.match_prefix(seq)
            if admitted and budget < seq.num_uncached <= beside_running:  # whole, next step
                self.blocks.free(seq)  # the matched blocks go back; the next try matches again
                break
            count = min(seq.num_uncached, budget)
            if not self.blocks.allocate(seq, seq.num_cached + count):
                self.blocks.free(seq)  # the matched blocks go back; the next try matches again
                break
            self.blocks.hit_tokens_total += hit
            self.blocks.register(seq, seq.num_cached + count)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            rows += seq.fan_out
            batch.seqs.append(seq)
            batch.num_new_tokens.append(count)
            budget -= count
            admitted = True
        return budget

    def _make_room(self, seq: Sequence, num_tokens: int, preempt: bool) -> bool:
        """Allocate `seq`'s blocks for `num_tokens`, preempting the newest running sequences
        while none is free (unless `preempt` is False); False if `seq` did not get them."""
        while not self.blocks.allocate(seq, num_tokens):
            if not preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks (again: a no-op)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:  # (a held one is in neither)
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def retire(self, seq: Sequence) -> None:
        """Take a sequence out of the batches but keep its blocks until `remove` (its last
        token is still being computed, and its blocks are worth caching once it is known)."""
        self.running.remove(seq)
        seq.status = Status.FINISHED

    def insert_running_after(self, parent: Sequence, children: list[Sequence]) -> None:
        """Forked samples run right after their parent (same age for preemption purposes)."""
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        for child in children:
            child.status = Status.RUNNING
