"""The asyncio side of an engine whose core runs elsewhere (a thread: engine.py; a process: process.py).

`EngineFront.generate` keeps one asyncio queue per open request. Whatever steps the core hands
each step's updates to `_deliver`, from any thread, which wakes each event loop once per step
(one `loop.call_soon_threadsafe`), not once per request. A consumer that fell behind takes every
step queued for it at once, merged into one update per sample, so a busy event loop handles
fewer, larger updates. When the core dies, `_die` fails every open stream with EngineDeadError,
later requests get it at once, `dead_reason` says why and `on_death` (if set) is called: the
server uses it to exit, so that a supervisor sees a dead server instead of one that answers
/health. A subclass says how a request reaches the core (`_add`) and leaves it (`_abort`).
A request whose context holds `RequestTimes` (`request_times`) gets the moments it entered the
core and its last update reached the event loop written into them.
"""

import asyncio
import contextlib
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from tandem.inference.engine.api import (
    EngineDeadError,
    EngineStats,
    RequestLimits,
    SampleUpdate,
    SamplingParams,
)

# How long a thread may hold the GIL while another waits for it (Python's default is 5 ms). The
# thread that steps the engine (or reads its updates) wants the GIL back as soon as it has work;
# with the default it could wait up to 5 ms behind the event loop formatting responses — as long
# as a whole decode step.
GIL_SWITCH_INTERVAL_S = 0.0005

# what a request's queue receives: a step's updates for it, or the error that ends it
Delivery = list[SampleUpdate] | BaseException


@dataclass
class RequestTimes:
    """Where a request's time went, as time.monotonic() (on Linux the clock of time.perf_counter
    in every process) and engine step counts; the last of its prompts counts."""

    received: float  # by the server
    admitted: float = 0.0  # handed to the engine core (its `_add` returned)
    admitted_step: int = 0  # engine steps run by then
    finished: float = 0.0  # its last update reached the event loop
    finished_step: int = 0

    def header(self, responded: float) -> str:
        """The times as an HTTP header value, with the moment the response was ready."""
        return (
            f"received={self.received:.6f};admitted={self.admitted:.6f};admitted_step={self.admitted_step};"
            f"finished={self.finished:.6f};finished_step={self.finished_step};responded={responded:.6f}"
        )


request_times: ContextVar[RequestTimes | None] = ContextVar("request_times", default=None)


class EngineFront(ABC):
    """Requests and their update streams on the event loop side. Invariant: a request id is in
    `_streams` exactly while its `generate` runs; `_deliver` drops updates of ids not there."""

    limits: RequestLimits  # set by the subclass once its core is built

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._dead: str | None = None
        self._dead_message: str | None = None  # what every request gets once the core died
        self._on_death: Callable[[], None] | None = None
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped for good (None while it runs)."""
        return self._dead

    @property
    def on_death(self) -> Callable[[], None] | None:
        """Called (from the thread that saw it) when the core dies, at once if it already has;
        one set in the instant of the death may be called twice."""
        return self._on_death

    @on_death.setter
    def on_death(self, callback: Callable[[], None] | None) -> None:
        self._on_death = callback
        if callback is not None and self._dead is not None:
            callback()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        stream: bool = True,
        stream_interval_s: float = 0.0,
    ) -> AsyncIterator[SampleUpdate]:
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)
        self.limits.check(prompt_token_ids, params, n)
        if request_id in self._streams:
            raise ValueError(f"request id '{request_id}' is already running")
        updates: asyncio.Queue[Delivery] = asyncio.Queue()
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), updates)
        remaining = n
        times = request_times.get()
        try:
            await self._add(request_id, prompt_token_ids, params, n, stream, stream_interval_s)
            if times is not None:
                times.admitted, times.admitted_step = time.monotonic(), self.stats().steps_total
            while remaining:
                batch = await updates.get()
                if isinstance(batch, BaseException):
                    raise batch
                if not updates.empty():  # coalesce steps that piled up while this consumer was busy
                    merged: dict[int, SampleUpdate] = {}
                    while True:
                        _merge_into(merged, batch)
                        if updates.empty():
                            break
                        batch = updates.get_nowait()
                        if isinstance(batch, BaseException):
                            raise batch
                    batch = list(merged.values())
                for update in batch:
                    if update.finish_reason is not None:
                        remaining -= 1
                        if not remaining and times is not None:
                            times.finished, times.finished_step = time.monotonic(), self.stats().steps_total
                    yield update
        finally:
            self._streams.pop(request_id, None)
            if remaining and not self._stopping:
                self._abort(request_id)

    @abstractmethod
    async def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int,
        stream: bool,
        stream_interval_s: float,
    ) -> None:
        """Hand a checked request to the core; its updates then arrive through `_deliver`, a
        failure to add it either raised here or delivered to its stream as an exception."""

    @abstractmethod
    def _abort(self, request_id: str) -> None:
        """Drop an unfinished request from the core (its consumer has gone); does not wait."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """The engine's counters (from another thread or process: as of its latest step)."""

    # ---- prefill on other servers (kv_prefix.py, kv_staging.py, kv_link.py) -------------------------------------------

    async def cached_prompt_tokens(self, token_ids: list[int]) -> int:
        """Tokens at the start of a prompt whose keys and values the prefix cache holds."""
        return await self._core_call("cached_prompt_tokens", token_ids)

    async def export_prompt(self, token_ids: list[int], skip_tokens: int = 0) -> bytes:
        """The cached keys and values of a prompt's reusable blocks after `skip_tokens`."""
        return await self._core_call("export_prompt", token_ids, skip_tokens)

    async def import_prompt(self, token_ids: list[int], data: bytes) -> int:
        """Adopt a prefill server's export for a prompt; the prompt tokens now cached. ValueError
        (nothing changed) for blocks that do not fit this engine."""
        return await self._core_call("import_prompt", token_ids, data)

    async def export_prompt_staged(self, token_ids: list[int], skip_tokens: int, buffer: int) -> dict:
        """`export_prompt` packed into staging buffer `buffer` (kv_staging.py); where it lies."""
        return await self._core_call("export_prompt_staged", token_ids, skip_tokens, buffer)

    async def import_prompt_staged(self, token_ids: list[int], staged: dict) -> int:
        """Adopt a staged export (kv_staging.py); returns once the buffer may be released."""
        return await self._core_call("import_prompt_staged", token_ids, staged)

    async def open_link(self) -> dict:
        """As a prefill server: a link for a decode server (kv_link.py); {"link", "port"}."""
        return await self._core_call("open_link")

    async def join_link(self, host: str, port: int, link: int) -> int:
        """As a decode server: join link `link` of the prefill engine whose store is at host:port."""
        return await self._core_call("join_link", host, port, link)

    async def link_state(self, number: int) -> str:
        """ "ready", "connecting" or "failed: why"."""
        return await self._core_call("link_state", number)

    async def close_link(self, number: int) -> None:
        await self._core_call("close_link", number)

    async def send_staged(self, number: int, buffer: int, nbytes: int, lease: int) -> None:
        """Queue a staged export's packed blocks (staging buffer `buffer`) on link `number`."""
        await self._core_call("send_staged", number, buffer, nbytes, lease)

    async def receive_prompt(self, number: int, nbytes: int, lease: int) -> int:
        """Queue the receive of a staged export's blocks on link `number`; a ticket."""
        return await self._core_call("receive_prompt", number, nbytes, lease)

    async def prompt_received(self, ticket: int) -> bool:
        """Whether a queued receive is over."""
        return await self._core_call("prompt_received", ticket)

    async def adopt_received(self, ticket: int, token_ids: list[int], staged: dict) -> int:
        """Wait for a queued receive and adopt its blocks."""
        return await self._core_call("adopt_received", ticket, token_ids, staged)

    @abstractmethod
    async def _core_call(self, method: str, *args: object) -> Any:
        """EngineCore.`method`(*args) run by the core between two steps; its result or error."""

    def _deliver(self, outputs: list[tuple[str, Delivery]]) -> None:
        """Hand one step's updates (or a request's error) to the event loops: one wake-up per loop.
        Callable from any thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delivery]]] = {}
        for request_id, delivery in outputs:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.updates, delivery))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_streams(self, message: str) -> None:
        """End every open stream with an EngineDeadError of its own (a raised exception collects
        the frames it passes: one shared by many consumers would grow with each)."""
        self._deliver([(request_id, EngineDeadError(message)) for request_id in list(self._streams)])

    def _die(self, reason: str, message: str) -> None:
        """The core stopped for good (`reason`); every open and later request gets an
        EngineDeadError saying `message`."""
        self._dead, self._dead_message = reason, message
        self._fail_streams(message)
        if self._on_death is not None:
            self._on_death()


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue


def _merge_into(merged: dict[int, SampleUpdate], updates: list[SampleUpdate]) -> None:
    """Append `updates` to the per-sample updates in `merged` (each sample's tokens in order); the
    first update of a sample becomes its merged one (updates belong to their receiver)."""
    for update in updates:
        known = merged.get(update.index)
        if known is None:
            merged[update.index] = update
        else:
            known.extend(update)


def _put_all(items: list[tuple[asyncio.Queue, Delivery]]) -> None:
    for updates_queue, delivery in items:
        updates_queue.put_nowait(delivery)
