"""One sample's state: its tokens, how many of them are in the KV cache, and its blocks."""

import itertools
from dataclasses import dataclass, field
from enum import Enum

from tandem.inference.engine.api import FinishReason, SampleUpdate, SamplingParams

_ids = itertools.count()
PLACEHOLDER = -1  # a sampled token that is still on its way from the device (core.py)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A sample being generated. A request with n > 1 starts as one sequence that prefills the
    prompt; when the prompt is done, it is forked into n samples that share the prompt's blocks.

    `num_cached` tokens of `token_ids` have their keys and values in the cache; the next step
    computes `token_ids[num_cached:]` (or a chunk of it) and, once all are computed, samples one token.
    """

    request: "Request"
    index: int  # sample index within the request; the prompt sequence of an n > 1 request has index 0
    token_ids: list[int]
    num_prompt_tokens: int
    fan_out: int = 1  # samples drawn when this sequence's prompt finishes (n for the prompt sequence)
    block_table: list[int] = field(default_factory=list)
    table_row: int = -1  # its row in BlockManager.tables while it holds blocks
    num_cached: int = 0
    # prefix cache (block_manager.py): blocks registered so far, the hash of the last one, and the
    # cache epoch the sequence's keys and values were computed in
    num_hashed: int = 0
    prefix_hash: int | None = None
    cache_epoch: int = -1
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached


@dataclass(eq=False)
class Request:
    """The n samples of one prompt, and where their updates go."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int
    keys: list[int | None]  # per sample, the sampler key derived from the seed (None: unseeded)
    arrival: int
    stream: bool = True  # False: updates are held until every sample has finished
    stream_interval: float = 0.0  # seconds between a streaming request's deliveries (0: every step)
    next_delivery: float = 0.0  # time.monotonic() before which it is not delivered again
    sequences: dict[int, Sequence] = field(default_factory=dict)  # live sequences by sample index
    finished: dict[int, FinishReason] = field(default_factory=dict)
    cancelled: dict[int, FinishReason] = field(default_factory=dict)  # finish once forked
    pending: dict[int, SampleUpdate] = field(default_factory=dict)  # tokens not yet delivered

    @property
    def done(self) -> bool:
        return len(self.finished) == self.n
