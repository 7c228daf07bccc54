"""The native engine's interface, as the HTTP server sees it.

The server speaks tokens to the engine: it tokenises prompts, detokenises outputs and matches
stop strings itself (asking the engine to finish a sample when one matches). The engine owns
scheduling, the KV cache, the model and sampling.
"""

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]

STAGING_LEASE_S = 60.0
"""How long a prefill server keeps a staging buffer lent to one export without its release
(kv_staging.py); the decode server copies out of it only within half that time."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0  # alternatives per token; the sampled token's logprob is always returned


@dataclass(slots=True)
class SampleUpdate:
    """New tokens of sample `index` (0 ≤ index < n) of a request, as columns: token `token_ids[i]`
    came from weights `weight_versions[i]` with logprob `logprobs[i]` = log_softmax(logits / T) at
    the sampled id (T = 1 if greedy), from the same logits it was sampled from; `top_logprobs[i]` are
    its alternatives (None when the request asked for none). `finish_reason` is set on the sample's
    last update. Columns, not an object per token: a finished sample of a few hundred tokens goes
    from the engine to the response as a few lists. An update belongs to whoever received it."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    top_logprobs: list[Sequence[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None

    def extend(self, later: "SampleUpdate") -> None:
        """Append the tokens of a `later` update of the same sample and take its finish reason."""
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.weight_versions += later.weight_versions
        if later.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs += later.top_logprobs
        self.finish_reason = later.finish_reason


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of an engine: fixed when the engine is built, so that a front in
    another thread or process checks requests without asking the engine."""

    max_n: int
    max_model_len: int
    kv_cache_tokens: int  # tokens the whole KV cache holds
    vocab_size: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams, n: int) -> None:
        """Raise ValueError (a client error) for a request the engine cannot serve."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if not 1 <= n <= self.max_n:
            raise ValueError(f"n must be between 1 and {self.max_n}, got {n}")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context is {self.max_model_len} tokens"
            )
        if len(prompt_token_ids) + 1 > self.kv_cache_tokens:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than the KV cache holds")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.min_p < 0:
            raise ValueError("temperature must be ≥ 0, top_p in (0, 1], min_p ≥ 0")


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    generated_tokens_total: int
    prompt_tokens_total: int
    weight_version: int
    paused: bool
    steps_total: int = 0  # engine steps run since start
    prefix_cache_hit_tokens_total: int = 0  # prompt tokens taken from the prefix cache, not computed
    prefill_tokens_total: int = 0  # prompt tokens computed (recomputation after preemption included)
    # host seconds of the engine's loop by phase since start: the core's schedule, model (inputs and
    # launches), sample (waiting for the device's tokens) and append; the loop's deliver and commands
    step_seconds: dict[str, float] = field(default_factory=dict)


class EngineDeadError(RuntimeError):
    """The engine stopped for good; no more tokens will come (the server answers 503)."""


class WeightLoadError(ValueError):
    """A checkpoint that cannot be loaded (missing, corrupt, wrong shapes); the old weights stay live."""


class WeightUpdateConflict(WeightLoadError):
    """An update the engine's state forbids now (paused with running requests that
    weight_update_mode = "wait" must let finish first); nothing changed (the server answers 409)."""


class Engine(Protocol):
    max_model_len: int
    weight_version: int
    dead_reason: str | None  # why the engine stopped for good; None while it runs

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        stream: bool = True,
        stream_interval_s: float = 0.0,
    ) -> AsyncIterator[SampleUpdate]:
        """Stream updates for the n samples of one prompt until all have finished (with
        `stream=False`, one update per sample when the whole request has finished; with
        `stream_interval_s`, at most one update per that many seconds after the first). Closing the
        iterator early (client gone) aborts the request and frees its KV blocks. A request the
        engine cannot serve (empty or too long prompt, n out of range, ids outside the
        vocabulary) raises ValueError at the first iteration."""
        ...

    async def finish_sample(self, request_id: str, index: int, reason: FinishReason = "stop") -> None:
        """End one sample now (the server matched a stop string); frees its blocks."""
        ...

    async def update_weights(self, path: Path, version: int | None = None) -> int:
        """Load a Hugging Face safetensors directory between engine steps; returns the new version
        (`version`, else N of a `step_N` directory, else the old version + 1).
        Raises WeightLoadError and keeps the old weights on any problem."""
        ...

    async def receive_weights(self, version: int) -> int:
        """Receive policy `version` over the in-memory transport of `weights.transport` between
        engine steps; returns it. The engine's receiver joined the trainer's weight link when the
        engine started, in the process that holds the model. Raises the transport's TransferError
        (TransferRefused: nothing changed; `partial` set: the weights now mix two versions) or
        LinkError (no link)."""
        ...

    async def weight_transport(self) -> str:
        """How new weights arrive: "filesystem", or the in-memory route (WeightReceiver.describe:
        "not linked" until the trainer has joined)."""
        ...

    async def cached_prompt_tokens(self, token_ids: list[int]) -> int:
        """Tokens at the start of a prompt whose keys and values the prefix cache holds and would
        reuse (a multiple of the block size)."""
        ...

    async def export_prompt(self, token_ids: list[int], skip_tokens: int = 0) -> bytes:
        """The cached keys and values of a prompt's reusable blocks after its first `skip_tokens`
        (kv_prefix.py), as far as the cache holds them."""
        ...

    async def import_prompt(self, token_ids: list[int], data: bytes) -> int:
        """Adopt another engine's `export_prompt` of this prompt into the prefix cache; returns the
        prompt tokens now cached. Raises ValueError, changing nothing, for blocks that do not fit."""
        ...

    async def export_prompt_staged(self, token_ids: list[int], skip_tokens: int, buffer: int) -> dict:
        """`export_prompt` packed into the engine's staging buffer `buffer`, for a server of the same
        machine (kv_staging.py); where it lies, the buffers' handle included."""
        ...

    async def import_prompt_staged(self, token_ids: list[int], staged: dict) -> int:
        """Adopt another engine's `export_prompt_staged` (with "received": the time.monotonic() its
        answer came); returns once its buffer is no longer read. ValueError as `import_prompt`."""
        ...

    async def open_link(self) -> dict:
        """As a prefill server: a link for a decode server (kv_link.py), waiting for it to join;
        {"link": its number, "port": the port of the store where the two meet}."""
        ...

    async def join_link(self, host: str, port: int, link: int) -> int:
        """As a decode server: join link `link` of the prefill engine whose store is at host:port
        (returns at once; `link_state` says when it is ready); this side's number for it."""
        ...

    async def link_state(self, number: int) -> str:
        """ "ready", "connecting" or "failed: why" (ValueError: no such link)."""
        ...

    async def close_link(self, number: int) -> None:
        """End this side of a link (nothing if there is none)."""
        ...

    async def send_staged(self, number: int, buffer: int, nbytes: int, lease: int) -> None:
        """As a prefill server: queue the first `nbytes` of staging buffer `buffer` (the packed
        blocks of the export that `lease` holds) on link `number`; the buffer is not packed again
        before the send is done. ValueError / RuntimeError: nothing was queued."""
        ...

    async def receive_prompt(self, number: int, nbytes: int, lease: int) -> int:
        """As a decode server: queue the receive of the `nbytes` the prefill engine queued on link
        `number` for export `lease` (returns at once); a ticket for `adopt_received`."""
        ...

    async def prompt_received(self, ticket: int) -> bool:
        """Whether a queued receive is over, so that `adopt_received` blocks the core no longer."""
        ...

    async def adopt_received(self, ticket: int, token_ids: list[int], staged: dict) -> int:
        """Wait for a queued receive (at most the link's timeout) and adopt its blocks, a staged
        export's; the prompt tokens now cached. RuntimeError: the transfer failed (the link with
        it); ValueError as `import_prompt`."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...
