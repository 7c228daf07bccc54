"""AsyncEngine: the engine core stepped by a background thread, bridged to asyncio.

Calls from the event loop become commands that the engine thread runs between two steps
(adding and aborting requests, pausing, loading weights), so the core is only ever changed by
one thread, which also builds it (`_start`). A step's token updates travel back with one
`loop.call_soon_threadsafe` into one asyncio queue per request. A consumer that fell behind takes every step queued for it at once,
merged into one update per sample, so a busy event loop handles fewer, larger updates. A request
generated with `stream=False` is held by the engine core until it has finished and is then
delivered whole: the event loop does no per-token work for it. The core keeps one step queued on
the device while the engine thread finishes the previous one (`EngineCore.step`); pausing drains
it. If the engine thread dies, every open stream and every later call gets EngineDeadError
instead of hanging, `dead_reason` says why, and `on_death` (if set) is called: the server uses it
to exit, so that a supervisor sees a dead server instead of one that answers /health.
"""

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import (
    EngineDeadError,
    EngineStats,
    FinishReason,
    SampleUpdate,
    SamplingParams,
    WeightLoadError,
)
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.lora import LoRAMerger, is_adapter_dir, read_adapter
from tandem.inference.engine.weights import parameter_specs, read_checkpoint, version_from_path
from tandem.transport.weight_buckets import spec_mismatch

if TYPE_CHECKING:
    from tandem.transport.weight_receiver import WeightReceiver

IDLE_WAIT_S = 0.05
# How long a thread may hold the GIL while another waits for it (Python's default is 5 ms). The
# engine thread wants the GIL back as soon as the GPU finishes a step; with the default it could
# wait up to 5 ms behind the event loop formatting responses — as long as a whole decode step.
GIL_SWITCH_INTERVAL_S = 0.0005
SHUTDOWN_WAIT_S = 30.0


class AsyncEngine:
    def __init__(self, config: InferenceConfig) -> None:
        self.model_name = config.served_model_name or config.model.name
        self.weight_update_mode = config.engine.weight_update_mode
        self.paused = False
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        # a weight update waiting for the engine thread: what gives its tensors, its version, its caller
        self._pending_update: tuple[Callable[[], Any], int, Future] | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.on_death: Callable[[], None] | None = None
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="tandem-engine", daemon=True)
        self._thread.start()
        self._started.wait()  # set whether the core was built or not (_start's finally)
        if self._start_error is not None:
            raise self._start_error
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len

    @property
    def weight_version(self) -> int:
        return self.core.weight_version

    @property
    def dead_reason(self) -> str | None:
        """Why the engine thread stopped (None while it runs)."""
        return None if self._error is None else repr(self._error)

    # ---- public API (event loop side) -------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        stream: bool = True,
        stream_interval_s: float = 0.0,
    ) -> AsyncIterator[SampleUpdate]:
        self.core.validate(prompt_token_ids, params, n)
        if request_id in self._streams:
            raise ValueError(f"request id '{request_id}' is already running")
        updates: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), updates)
        remaining = n
        try:
            await self._call(
                lambda: self.core.add_request(
                    request_id, prompt_token_ids, params, n, stream, stream_interval_s
                )
            )
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
                    yield update
        finally:
            self._streams.pop(request_id, None)
            if remaining and not self._stopping:
                self._submit(lambda: self.core.abort(request_id))

    async def finish_sample(self, request_id: str, index: int, reason: FinishReason = "stop") -> None:
        await self._call(lambda: self.core.finish_sample(request_id, index, reason))

    async def update_weights(self, path: Path, version: int | None = None) -> int:
        """Load `path` between steps: a Hugging Face checkpoint, or a PEFT LoRA adapter merged onto the
        base weights (engine/lora.py). The version is `version`, else N of a `step_N` directory,
        else the current version + 1. Raises WeightLoadError; the old weights stay live then."""
        tensors = await asyncio.to_thread(self._read_update, Path(path))
        if version is None:
            version = version_from_path(Path(path))
        if version is None:
            version = self.core.weight_version + 1
        done: Future = Future()
        await self._call(lambda: self._queue_update(tensors, version, done))
        return await asyncio.wrap_future(done)

    def _read_update(self, path: Path) -> Callable[[], Any]:
        """Read and check a weights directory (off the engine thread); what gives its tensors."""
        if not is_adapter_dir(path):
            tensors = read_checkpoint(path, self.core.model)
            return lambda: self.lora.full(tensors)
        config, adapter = read_adapter(path)
        problem = self.lora.check(config, {name: tuple(t.shape) for name, t in adapter.items()})
        if problem:
            raise WeightLoadError(f"adapter '{path}' does not fit the model: {problem}")
        return lambda: self.lora.merged(config, adapter.items())

    async def receive_weights(self, receiver: "WeightReceiver", version: int) -> int:
        """Receive policy `version` over the in-memory weight transport, between steps as
        `update_weights` loads. Raises the transfer's error; a refused transfer changes nothing."""

        def begin() -> Any:
            offer = receiver.offer(version)
            config = offer.meta.get("adapter_config")
            if config is None:
                expected, optional = parameter_specs(self.core.model)
                return self.lora.full(receiver.accept(offer, spec_mismatch(offer.specs, expected, optional)))
            problem = self.lora.check(config, {spec.name: spec.shape for spec in offer.specs})
            return self.lora.merged(config, receiver.accept(offer, problem))

        done: Future = Future()
        await self._call(lambda: self._queue_update(begin, version, done))
        return await asyncio.wrap_future(done)

    async def pause(self) -> None:
        """Stop stepping after the current step; requests stay in place."""
        await self._call(self._pause)

    async def resume(self) -> None:
        await self._call(lambda: setattr(self, "paused", False))

    def stats(self) -> EngineStats:
        core = self.core
        return EngineStats(
            running=len(core.scheduler.running),
            waiting=len(core.scheduler.waiting) + len(core.held),
            kv_blocks_used=core.blocks.num_usable - core.blocks.num_free,
            kv_blocks_total=core.blocks.num_usable,
            generated_tokens_total=core.generated_tokens_total,
            prompt_tokens_total=core.prompt_tokens_total,
            weight_version=core.weight_version,
            paused=self.paused,
            steps_total=core.num_steps,
            prefix_cache_hit_tokens_total=core.blocks.hit_tokens_total,
            prefill_tokens_total=core.scheduler.prefill_tokens_total,
        )

    async def shutdown(self) -> None:
        self._stopping = True
        self._submit(lambda: None)  # wake the thread
        await asyncio.to_thread(self._thread.join, SHUTDOWN_WAIT_S)
        self._fail_streams(EngineDeadError("the engine was shut down"))

    # ---- engine thread ----------------------------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if self._error is not None:
            future.set_exception(EngineDeadError(f"the engine thread died: {self._error!r}"))
        else:
            self._commands.put((fn, future))
        return future

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _queue_update(self, tensors: Callable[[], Any], version: int, done: Future) -> None:
        if self._pending_update is not None:  # a newer checkpoint replaces one not yet applied
            replaced = WeightLoadError(f"replaced by version {version} before it was applied")
            self._pending_update[2].set_exception(replaced)
        self._pending_update = (tensors, version, done)
        if self.weight_update_mode == "wait":
            self.core.hold_new = True

    def _apply_pending_update(self) -> None:
        """finish_old: apply now; wait: apply once the requests that were running have finished."""
        if self._pending_update is None:
            return
        if self.weight_update_mode == "wait" and self.core.num_active_requests > 0:
            return
        tensors, version, done = self._pending_update
        self._pending_update = None
        try:
            self.core.apply_weights(tensors(), version)
        except Exception as e:
            done.set_exception(e)
        else:
            done.set_result(version)
        self.core.release_held()

    def _pause(self) -> None:
        self.paused = True
        self._deliver(self.core.drain())  # the step queued on the device finishes now

    def _start(self, config: InferenceConfig) -> bool:
        """Build the core on the engine thread, so that one thread does all of its torch work:
        on a CPU, stepping a core that another thread built (whose intra-op OpenMP team then
        exists beside the engine thread's) ran at 0.7× the speed, built here at full speed."""
        try:
            self.core = EngineCore(config)
            self.lora = LoRAMerger(self.core.model, config.engine.lora_base_on_cpu)
            return True
        except BaseException as e:  # noqa: BLE001 — raised by __init__ on the caller's thread
            self._start_error = e
            return False
        finally:
            self._started.set()

    def _run(self, config: InferenceConfig) -> None:
        if not self._start(config):
            return
        try:
            while not self._stopping:
                idle = self.paused or not self.core.has_work()
                self._run_commands(block=idle)
                self._apply_pending_update()
                if self.paused or self._stopping or not self.core.has_work():
                    continue
                self._deliver(self.core.step())
        except BaseException as e:  # noqa: BLE001 — reported to every waiting caller
            self._error = e
            self._fail_streams(EngineDeadError(f"the engine thread died: {e!r}"))
            if self.on_death is not None:
                self.on_death()
            raise
        finally:
            self._drain_commands()

    def _run_commands(self, block: bool) -> None:
        deadline = time.monotonic() + IDLE_WAIT_S
        while True:
            try:
                timeout = max(0.0, deadline - time.monotonic()) if block else None
                fn, future = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)

    def _drain_commands(self) -> None:
        error = EngineDeadError("the engine is not running")
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            with contextlib.suppress(Exception):
                future.set_exception(error)
        if self._pending_update is not None:
            self._pending_update[2].set_exception(error)

    def _deliver(self, outputs: list[tuple[str, list[SampleUpdate]]]) -> None:
        """Hand a step's updates to the event loops: one wake-up per loop, not per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list[SampleUpdate]]]] = {}
        for request_id, updates in outputs:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.updates, updates))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.updates.put_nowait, error)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue


def _merge_into(merged: dict[int, SampleUpdate], updates: list[SampleUpdate]) -> None:
    """Append `updates` to the per-sample updates in `merged` (each sample's tokens in order)."""
    for update in updates:
        known = merged.get(update.index)
        if known is None:
            merged[update.index] = SampleUpdate(update.index, list(update.tokens), update.finish_reason)
        else:
            known.tokens.extend(update.tokens)
            known.finish_reason = update.finish_reason


def _put_all(items: list[tuple[asyncio.Queue, list[SampleUpdate]]]) -> None:
    for updates_queue, updates in items:
        updates_queue.put_nowait(updates)
