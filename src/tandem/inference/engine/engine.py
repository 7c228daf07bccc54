"""AsyncEngine: the engine core stepped by a background thread of the server, bridged to asyncio.

The thread builds a `CoreLoop` (loop.py) and runs it: calls from the event loop become commands
it runs between two steps, and each step's updates reach the event loop through `EngineFront`
(streams.py). A request generated with `stream=False` is held by the engine core until it has
finished and is then delivered whole: the event loop does no per-token work for it. If the
thread dies, every open stream and every later call gets EngineDeadError instead of hanging.
`engine.core_process` runs the same loop in a process of its own instead (process.py).
"""

import asyncio
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import EngineStats, FinishReason, SamplingParams
from tandem.inference.engine.loop import CoreLoop
from tandem.inference.engine.streams import EngineFront

SHUTDOWN_WAIT_S = 30.0


class AsyncEngine(EngineFront):
    def __init__(self, config: InferenceConfig) -> None:
        super().__init__()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="tandem-engine", daemon=True)
        self._thread.start()
        self._started.wait()  # set whether the core was built or not (_run)
        if self._start_error is not None:
            raise self._start_error
        self.core = self.core_loop.core
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.limits = self.core.limits

    @property
    def weight_version(self) -> int:
        return self.core.weight_version

    # ---- public API (event loop side) -------------------------------------------------------

    async def finish_sample(self, request_id: str, index: int, reason: FinishReason = "stop") -> None:
        await self._call(lambda: self.core.finish_sample(request_id, index, reason))

    async def update_weights(self, path: Path, version: int | None = None) -> int:
        """Load `path` between steps (CoreLoop.update_weights: checkpoint or LoRA adapter, which
        version). Raises WeightLoadError; the old weights stay live then."""
        done = await asyncio.to_thread(self.core_loop.update_weights, Path(path), version)
        return await asyncio.wrap_future(done)

    async def receive_weights(self, version: int) -> int:
        """Receive policy `version` over the in-memory weight transport, between steps as
        `update_weights` loads. Raises the transfer's error; a refused transfer changes nothing."""
        return await asyncio.wrap_future(self.core_loop.receive_weights(version))

    async def weight_transport(self) -> str:
        return self.core_loop.weight_transport()

    async def pause(self) -> None:
        """Stop stepping after the current step; requests stay in place."""
        await self._call(self.core_loop.pause)

    async def resume(self) -> None:
        await self._call(self.core_loop.resume)

    def stats(self) -> EngineStats:
        return self.core_loop.stats()

    async def shutdown(self) -> None:
        self._stopping = True
        self.core_loop.stop()
        await asyncio.to_thread(self._thread.join, SHUTDOWN_WAIT_S)
        self._fail_streams("the engine was shut down")

    # ---- EngineFront ------------------------------------------------------------------------

    async def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int,
        stream: bool,
        stream_interval_s: float,
    ) -> None:
        await self._call(
            lambda: self.core.add_request(request_id, prompt_token_ids, params, n, stream, stream_interval_s)
        )

    def _abort(self, request_id: str) -> None:
        self.core_loop.submit(lambda: self.core.abort(request_id))

    # ---- the engine thread ------------------------------------------------------------------

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.core_loop.submit(fn))

    async def _core_call(self, method: str, *args: object) -> Any:
        return await self._call(partial(getattr(self.core, method), *args))

    def _run(self, config: InferenceConfig) -> None:
        try:
            self.core_loop = CoreLoop(config, self._deliver)  # built here: see loop.py
        except BaseException as e:  # noqa: BLE001 — raised by __init__ on the caller's thread
            self._start_error = e
            return
        finally:
            self._started.set()
        try:
            self.core_loop.run()
        except BaseException as e:  # noqa: BLE001 — reported to every waiting caller
            self._die(repr(e), f"the engine thread died: {e!r}")
            raise
