"""CoreLoop: the thread that steps an EngineCore, and the commands it runs between two steps.

The same loop runs in a thread of the server (engine.py) and in the engine process (process.py).
Calls from other threads (adding and aborting requests, pausing, loading weights) become
commands (`submit`), so the core is only ever changed by the loop's thread, which also builds it:
on a CPU, stepping a core that another thread built (whose intra-op OpenMP team then exists
beside the stepping thread's) ran at 0.7× the speed. The core keeps one step queued on the device
while the loop finishes the previous one (`EngineCore.step`); pausing drains it. Each step's
updates go to `emit`, once per step, and once more after commands that no step follows, so that
a copy of `stats()` taken there stays current. With an in-memory weight transport
(`weights.transport` broadcast or colocated) the loop owns the `WeightReceiver`, built beside
the core (the process that holds the model's tensors must receive them).
"""

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tandem.cli import UserError
from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import (
    EngineDeadError,
    EngineStats,
    SampleUpdate,
    WeightLoadError,
    WeightUpdateConflict,
)
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.lora import LoRAMerger, is_adapter_dir, read_adapter
from tandem.inference.engine.weights import parameter_specs, read_checkpoint, version_from_path
from tandem.transport.config import WeightsConfig
from tandem.transport.weight_buckets import spec_mismatch
from tandem.transport.weight_link import LinkError, LinkSettings
from tandem.transport.weight_receiver import WeightReceiver

IDLE_WAIT_S = 0.05

log = logging.getLogger("tandem.inference")

Emit = Callable[[list[tuple[str, list[SampleUpdate]]]], None]


class CoreLoop:
    """Build on the thread that will call `run`. Invariant: only that thread touches the core;
    every submitted command's future is resolved, by the loop or, once it stopped, with
    EngineDeadError."""

    def __init__(self, config: InferenceConfig, emit: Emit) -> None:
        link = _link_settings(config.weights)  # before the core: a bad [weights] fails at once
        self.core = EngineCore(config)
        self.lora = LoRAMerger(self.core.model, config.engine.lora_base_on_cpu)
        self.emit = emit
        self.weight_update_mode = config.engine.weight_update_mode
        self.paused = False
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._lock = threading.Lock()  # orders `submit` against the loop's closing
        self._closed: str | None = None  # why commands are refused
        # a weight update waiting for the loop: what gives its tensors, its version, its caller
        self._pending_update: tuple[Callable[[], Any], int, Future] | None = None
        self._stopping = False
        self.timings = {"deliver": 0.0, "commands": 0.0}  # host seconds between steps, beside core.timings
        # set iff the transport is in-memory; closed when `run` ends
        self.receiver = None if link is None else _start_receiver(link, config.weights, self.core)

    # ---- any thread -------------------------------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop's thread between two steps; its result or exception ends up in
        the returned future (EngineDeadError once the loop has stopped)."""
        future: Future = Future()
        with self._lock:
            if self._closed is None:
                self._commands.put((fn, future))
                return future
        future.set_exception(EngineDeadError(self._closed))
        return future

    def stop(self) -> None:
        """Make `run` return after the current step."""
        self._stopping = True
        self.submit(lambda: None)  # wake the loop

    def update_weights(self, path: Path, version: int | None) -> Future:
        """Read and check `path` on the calling thread (not the loop's), then queue it; the
        future gives the new version. `path` is a Hugging Face checkpoint or a PEFT LoRA adapter
        merged onto the base weights (engine/lora.py); the version is `version`, else N of a
        `step_N` directory, else the current version + 1. Raises WeightLoadError (or the future
        does); the old weights stay live then."""
        tensors = self._read_update(path)
        if version is None:
            version = version_from_path(path)
        if version is None:
            version = self.core.weight_version + 1
        return self._queue(tensors, version)

    def receive_weights(self, version: int) -> Future:
        """Receive policy `version` by the loop's receiver when the loop applies it; the future
        gives the version or the transfer's error (TransferRefused: nothing changed; LinkError
        without an in-memory transport)."""
        receiver = self.receiver

        def begin() -> Any:
            if receiver is None:
                raise LinkError("weights.transport is 'filesystem': this server has no weight link")
            offer = receiver.offer(version)
            config = offer.meta.get("adapter_config")
            if config is None:
                expected, optional = parameter_specs(self.core.model)
                return self.lora.full(receiver.accept(offer, spec_mismatch(offer.specs, expected, optional)))
            problem = self.lora.check(config, {spec.name: spec.shape for spec in offer.specs})
            return self.lora.merged(config, receiver.accept(offer, problem))

        return self._queue(begin, version)

    def weight_transport(self) -> str:
        """How new weights arrive: "filesystem", or the receiver's route ("not linked" until the
        trainer has joined)."""
        return "filesystem" if self.receiver is None else self.receiver.describe()

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
            step_seconds={**core.timings, **self.timings},
        )

    # ---- the loop's thread ------------------------------------------------------------------

    def pause(self) -> None:
        """Stop stepping after the current step (finished now); requests stay in place."""
        self.paused = True
        self.emit(self.core.drain())

    def resume(self) -> None:
        self.paused = False

    def run(self) -> None:
        """Step while there is work, run commands between steps, until `stop()`; raises what
        killed it, after failing every command still queued."""
        try:
            timings = self.timings
            while not self._stopping:
                core = self.core
                block = self.paused or not core.has_work()
                start = time.perf_counter()
                ran = self._run_commands(block=block)
                self._apply_pending_update()
                if self.paused or self._stopping or not core.has_work():
                    if ran:
                        self.emit([])
                    continue
                stepped = time.perf_counter()
                if not block:  # (a blocking wait is idle time, not the loop's work)
                    timings["commands"] += stepped - start
                updates = core.step()
                delivering = time.perf_counter()
                self.emit(updates)
                timings["deliver"] += time.perf_counter() - delivering
        finally:
            self._close("the engine is not running")
            self.core.close_staging()
            if self.receiver is not None:
                self.receiver.close()

    def _queue(self, tensors: Callable[[], Any], version: int) -> Future:
        done: Future = Future()
        queued = self.submit(lambda: self._queue_update(tensors, version, done))
        queued.add_done_callback(lambda f: _pass_failure(f, done))
        return done

    def _read_update(self, path: Path) -> Callable[[], Any]:
        """Read and check a weights directory; what gives its tensors."""
        try:
            adapter_dir = is_adapter_dir(path)
        except OSError as e:  # a name too long, a directory this process may not read
            raise WeightLoadError(f"cannot read '{path}': {e.strerror}") from None
        if not adapter_dir:
            tensors = read_checkpoint(path, self.core.model)
            return lambda: self.lora.full(tensors)
        config, adapter = read_adapter(path)
        problem = self.lora.check(config, {name: tuple(t.shape) for name, t in adapter.items()})
        if problem:
            raise WeightLoadError(f"adapter '{path}' does not fit the model: {problem}")
        return lambda: self.lora.merged(config, adapter.items())

    def _queue_update(self, tensors: Callable[[], Any], version: int, done: Future) -> None:
        running = self.core.num_active_requests
        if self.weight_update_mode == "wait" and self.paused and running:
            done.set_exception(  # (it would wait for requests that a paused engine never finishes)
                WeightUpdateConflict(
                    f"the engine is paused with {running} running request(s), which weight_update_mode = "
                    "'wait' lets finish before an update: resume first (or update before pausing)"
                )
            )
            return
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

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting up to IDLE_WAIT_S for one if `block`); whether any ran."""
        deadline = time.monotonic() + IDLE_WAIT_S
        ran = False
        while True:
            try:
                timeout = max(0.0, deadline - time.monotonic()) if block else None
                fn, future = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return ran
            block, ran = False, True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)

    def _close(self, reason: str) -> None:
        with self._lock:
            self._closed = reason
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            with contextlib.suppress(Exception):
                future.set_exception(EngineDeadError(reason))
        if self._pending_update is not None:
            self._pending_update[2].set_exception(EngineDeadError(reason))


def _link_settings(weights: WeightsConfig) -> LinkSettings | None:
    """Where the trainer's weight link meets; None with the filesystem transport."""
    if not weights.in_memory:
        return None
    try:
        return LinkSettings.of(weights)
    except LinkError as e:
        raise UserError(str(e)) from None


def _start_receiver(link: LinkSettings, weights: WeightsConfig, core: EngineCore) -> WeightReceiver:
    """Join the trainer's weight link in the background, to receive into the core's device and dtype."""
    receiver = WeightReceiver(link, weights.server_index, weights.transport, core.device, core.dtype)
    receiver.start()
    log.info("weights by %s: joining the trainer at %s", weights.transport, link.address)
    return receiver


def _pass_failure(source: Future, target: Future) -> None:
    """A failed `source` fails `target` (the queued update never reached the loop)."""
    error = source.exception()
    if error is not None and not target.done():
        target.set_exception(error)
