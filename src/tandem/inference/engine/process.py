"""ProcessEngine: the engine core stepped by a process of its own (`engine.core_process`).

The server process keeps the HTTP front, the tokenizer and the per-request streams
(streams.EngineFront); a child started with multiprocessing's "spawn" (CUDA needs it) builds the
EngineCore and runs the same CoreLoop as the thread engine (loop.py) on its main thread. Only a
pipe connects the two, so the event loop and the engine no longer share one GIL.

Messages are tuples pickled with protocol 5:

    server → engine   (kind, call_id, *args); kind is add, abort, finish, pause, resume, update,
                      receive, transport, core (an EngineCore method of CORE_CALLS) or stop; a
                      call_id (None for add, abort and stop) asks for a reply
    engine → server   ("ready", facts) or ("failed", error, traceback), once, at start;
                      ("out", stats, updates, rejected) once per step, and once after commands
                      that no step follows: every request's new tokens as plain lists (`_encode`),
                      and (request id, why) for each add the core refused;
                      ("reply", stats, call_id, ok, result or error);
                      ("died", why) before the engine exits on an error

Every message from the engine carries a copy of its stats, which `stats()` and `weight_version`
read; the copy is taken under the send lock, so that whichever thread sends, later messages
carry later stats. In the server a reader thread blocks on the pipe (the GIL released while it waits),
unpickles each message and hands a step's updates to the event loop with one
`call_soon_threadsafe`. When the engine process dies (killed, crashed) the reader sees the pipe
close: every open stream and pending call gets EngineDeadError, `dead_reason` gives the exit
code (and the error), `on_death` is called. The engine process ignores SIGINT and SIGTERM (a
supervisor signals the whole process group): it stops when the server tells it (`shutdown`) or
when the server's end of the pipe closes.

With an in-memory weight transport the engine process's CoreLoop owns the WeightReceiver (the
receiver must live beside the model's tensors); "receive" runs a transfer there, and its error
comes back pickled, type and `partial` included.
"""

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import (
    EngineDeadError,
    EngineStats,
    FinishReason,
    SampleUpdate,
    SamplingParams,
)
from tandem.inference.engine.streams import GIL_SWITCH_INTERVAL_S, EngineFront
from tandem.models.loading import load_tokenizer

if TYPE_CHECKING:
    from tandem.inference.engine.loop import CoreLoop

START_TIMEOUT_S = 1800.0  # building the core: reading the weights, sizing the KV cache, capturing graphs
CALL_TIMEOUT_S = 300.0  # pause, resume, finish_sample: answered between two steps
EXIT_WAIT_S = 30.0  # for the engine process to exit once stopped, or once its pipe closed

log = logging.getLogger("tandem.inference")

CORE_CALLS = frozenset(
    {
        "cached_prompt_tokens", "export_prompt", "export_prompt_staged", "import_prompt", "import_prompt_staged",
        "open_link", "join_link", "link_state", "close_link", "send_staged", "receive_prompt", "prompt_received",
        "adopt_received",
    }
)  # fmt: skip
"""The EngineCore methods a "core" message may run (EngineFront._core_call)."""

# one sample's update on the wire: SampleUpdate's columns, with one weight version for all tokens
# where they share it
WireUpdate = tuple[int, list[int], list[float], int | list[int], list | None, FinishReason | None]


class ProcessEngine(EngineFront):
    """The server's side of the engine process. Invariant: every call registered in `_calls` is
    answered by the engine, or failed with EngineDeadError once the pipe has closed."""

    def __init__(self, config: InferenceConfig) -> None:
        super().__init__()
        context = multiprocessing.get_context("spawn")
        self._conn, engine_end = context.Pipe()
        self._process = context.Process(
            target=run_engine_process, args=(config, engine_end), name="tandem-engine-core", daemon=True
        )
        self._process.start()
        engine_end.close()  # so that the engine's death closes the pipe
        try:
            self.tokenizer = load_tokenizer(config.model.name)  # while the engine builds its core
            facts = self._wait_ready()
        except BaseException:
            self._process.kill()
            self._process.join(EXIT_WAIT_S)
            self._conn.close()
            raise
        self.max_model_len: int = facts["max_model_len"]
        self.limits = facts["limits"]
        self._stats: EngineStats = facts["stats"]
        self._send_lock = threading.Lock()
        self._calls_lock = threading.Lock()  # orders registering a call against the reader's end
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._closed: str | None = None  # why the pipe closed (set under _calls_lock)
        self._reader = threading.Thread(target=self._read, name="tandem-engine-reader", daemon=True)
        self._reader.start()
        log.info("engine core built in process %d", self._process.pid)

    @property
    def weight_version(self) -> int:
        return self._stats.weight_version

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    # ---- public API (event loop side) -------------------------------------------------------

    async def finish_sample(self, request_id: str, index: int, reason: FinishReason = "stop") -> None:
        await self._call("finish", request_id, index, reason)

    async def update_weights(self, path: Path, version: int | None = None) -> int:
        """Load `path` in the engine process (CoreLoop.update_weights: checkpoint or LoRA adapter,
        which version). Raises WeightLoadError; the old weights stay live then. No timeout of its
        own: with weight_update_mode = "wait" it waits for the running requests; the engine's
        death ends the wait."""
        return await self._call("update", str(path), version, timeout_s=None)

    async def receive_weights(self, version: int) -> int:
        """Receive policy `version` by the engine process's receiver (CoreLoop.receive_weights).
        Raises the transfer's error, rebuilt here with its type and `partial`; a refused transfer
        changes nothing. No timeout of its own: the transfer has weights.transfer_timeout_s, and
        with weight_update_mode = "wait" it waits for the running requests."""
        return await self._call("receive", version, timeout_s=None)

    async def weight_transport(self) -> str:
        """Answered by the engine process's command thread, even while the loop is in a transfer."""
        return await self._call("transport")

    async def pause(self) -> None:
        """Stop stepping after the current step; requests stay in place."""
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    def stats(self) -> EngineStats:
        """The engine's stats as of its last message (after its last step or command)."""
        return self._stats

    async def shutdown(self) -> None:
        """Stop the engine process; kill it if it has not exited after EXIT_WAIT_S."""
        self._stopping = True
        with contextlib.suppress(EngineDeadError):
            self._send(("stop", None))
        await asyncio.to_thread(self._reader.join, EXIT_WAIT_S)
        if self._reader.is_alive():
            log.warning("the engine process did not stop within %g s; killing it", EXIT_WAIT_S)
            self._process.kill()
            await asyncio.to_thread(self._reader.join, EXIT_WAIT_S)
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
        self._send(("add", None, request_id, prompt_token_ids, params, n, stream, stream_interval_s))

    async def _core_call(self, method: str, *args: object) -> Any:
        return await self._call("core", method, *args)

    def _abort(self, request_id: str) -> None:
        if self._closed is None:
            with contextlib.suppress(EngineDeadError):
                self._send(("abort", None, request_id))

    # ---- the pipe, server side --------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self._closed is not None:
            raise EngineDeadError(self._closed)
        data = pickle.dumps(message, protocol=5)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as e:
            raise EngineDeadError(self._closed or f"the engine process cannot be reached: {e!r}") from None

    async def _call(self, kind: str, *args: Any, timeout_s: float | None = CALL_TIMEOUT_S) -> Any:
        """Send a command and await its reply (TimeoutError naming it after `timeout_s`)."""
        future: Future = Future()
        with self._calls_lock:
            if self._closed is not None:
                raise EngineDeadError(self._closed)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        try:
            self._send((kind, call_id, *args))
            waiting = asyncio.wrap_future(future)
            done, _ = await asyncio.wait({waiting}, timeout=timeout_s)
            if not done:
                waiting.cancel()
                raise TimeoutError(f"the engine process did not answer '{kind}' within {timeout_s:g} s")
            return waiting.result()
        finally:
            with self._calls_lock:
                self._calls.pop(call_id, None)

    def _wait_ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._conn.poll(1.0) and self._process.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine process did not build the engine core within {START_TIMEOUT_S:g} s"
                )
        try:
            message = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._process.join(EXIT_WAIT_S)
            raise EngineDeadError(
                f"the engine process exited with code {self._process.exitcode} before it was ready"
            ) from None
        if message[0] == "failed":
            _, error, trace = message
            raise error from EngineTraceback(trace)
        return message[1]

    def _read(self) -> None:
        """The reader thread: one message at a time until the pipe closes, then the end."""
        why: str | None = None
        try:
            while True:
                try:
                    message = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    break
                kind = message[0]
                if kind == "out":
                    _, self._stats, outputs, rejected = message
                    if outputs or rejected:
                        self._deliver(self._decoded(outputs, rejected))
                elif kind == "reply":
                    _, self._stats, call_id, ok, value = message
                    with self._calls_lock:
                        future = self._calls.pop(call_id, None)
                    if future is not None and future.set_running_or_notify_cancel():
                        future.set_result(value) if ok else future.set_exception(value)
                else:  # "died"
                    why = message[1]
        except BaseException as e:  # noqa: BLE001 — a message the server cannot read: the engine is lost
            why = f"the server could not read the engine's messages: {e!r}"
            self._process.kill()
        self._end(why)

    def _end(self, why: str | None) -> None:
        """The pipe closed: reap the engine process, fail every pending call, and unless this
        was a shutdown, every stream (EngineFront._die)."""
        self._process.join(EXIT_WAIT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(EXIT_WAIT_S)
        reason = f"exit code {self._process.exitcode}" + (f": {why}" if why else "")
        message = "the engine was shut down" if self._stopping else f"the engine process died ({reason})"
        with self._calls_lock:
            self._closed = message
            calls, self._calls = self._calls, {}
        for future in calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(message))
        self._conn.close()
        if not self._stopping:
            self._die(reason, message)

    def _decoded(
        self, outputs: list[tuple[str, list[WireUpdate]]], rejected: list[tuple[str, str]]
    ) -> list[tuple[str, list[SampleUpdate] | BaseException]]:
        streams = self._streams
        out: list[tuple[str, list[SampleUpdate] | BaseException]] = [
            (request_id, [_decode(*update) for update in updates])
            for request_id, updates in outputs
            if request_id in streams
        ]
        out += [(request_id, ValueError(why)) for request_id, why in rejected]
        return out


class EngineTraceback(Exception):
    """The engine process's traceback of an error raised there (the cause of its copy here)."""

    def __str__(self) -> str:
        return f"\n\nin the engine process:\n{self.args[0]}"


def _encode(update: SampleUpdate) -> WireUpdate:
    versions: int | list[int] = update.weight_versions
    if versions and versions.count(versions[0]) == len(versions):
        versions = versions[0]  # one version for all tokens, the usual case
    return (
        update.index,
        update.token_ids,
        update.logprobs,
        versions,
        update.top_logprobs,
        update.finish_reason,
    )


def _decode(
    index: int,
    ids: list[int],
    logprobs: list[float],
    versions: int | list[int],
    tops: list | None,
    reason: FinishReason | None,
) -> SampleUpdate:
    per_token = [versions] * len(ids) if isinstance(versions, int) else versions
    return SampleUpdate(index, ids, logprobs, per_token, tops, reason)


# ---- the engine process ------------------------------------------------------------------------


def run_engine_process(config: InferenceConfig, conn: Connection) -> None:
    """The engine process's main: build the core, say "ready" (or "failed"), step until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s (engine process): %(message)s",
        stream=sys.stderr,
    )
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    side = _EngineSide(conn)
    try:
        side.start(config)
    except BaseException as e:  # noqa: BLE001 — raised again in the server process
        side.send(("failed", _portable(e), traceback.format_exc()))
        return
    threading.Thread(target=side.serve_commands, name="tandem-engine-commands", daemon=True).start()
    try:
        side.core_loop.run()
    except BaseException as e:  # noqa: BLE001 — reported to the server, which fails every stream
        log.exception("the engine loop died")
        with contextlib.suppress(OSError):
            side.send(("died", repr(e)))
        raise SystemExit(1) from None


class _EngineSide:
    """The engine process's end of the pipe. Sends come from the loop's thread (steps, and replies
    to the commands it runs), the command thread (the weight transport) and update threads
    (updates refused before queuing)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.rejected: list[tuple[str, str]] = []  # adds the core refused, sent with the next "out"
        self.core_loop: CoreLoop

    def start(self, config: InferenceConfig) -> None:
        from tandem.inference.cli import freeze_heap
        from tandem.inference.engine.loop import CoreLoop

        self.core_loop = CoreLoop(config, self.emit)
        freeze_heap()
        core = self.core_loop.core
        facts = {"max_model_len": core.max_model_len, "limits": core.limits, "stats": self.core_loop.stats()}
        self.send(("ready", facts))

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=5)
        with self.lock:
            self.conn.send_bytes(data)

    def send_with_stats(self, kind: str, *fields: Any) -> None:
        """Send (kind, the engine's stats now, *fields)."""
        with self.lock:
            self.conn.send_bytes(pickle.dumps((kind, self.core_loop.stats(), *fields), protocol=5))

    def emit(self, outputs: list[tuple[str, list[SampleUpdate]]]) -> None:
        rejected, self.rejected = self.rejected, []
        encoded = [(request_id, [_encode(u) for u in updates]) for request_id, updates in outputs]
        self.send_with_stats("out", encoded, rejected)

    def serve_commands(self) -> None:
        """The command thread: each command becomes a CoreLoop command until "stop" or until the
        server's end of the pipe closes."""
        core_loop, core = self.core_loop, self.core_loop.core
        commands = {
            "add": core.add_request,
            "abort": core.abort,
            "finish": core.finish_sample,
            "pause": core_loop.pause,
            "resume": core_loop.resume,
        }
        while True:
            try:
                kind, call_id, *args = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                kind, call_id = "stop", None  # the server has gone
            if kind == "stop":
                core_loop.stop()
                return
            if kind == "update":
                threading.Thread(target=self._update, args=(call_id, *args), daemon=True).start()
                continue
            if kind == "receive":
                core_loop.receive_weights(*args).add_done_callback(partial(self._reply, call_id))
                continue
            if kind == "transport":
                self._answer(call_id, True, core_loop.weight_transport())
                continue
            if kind == "core":  # an EngineFront._core_call
                method, *args = args
                if method not in CORE_CALLS:
                    self._answer(call_id, False, ValueError(f"'{method}' is not one of {sorted(CORE_CALLS)}"))
                    continue
                core_loop.submit(partial(getattr(core, method), *args)).add_done_callback(
                    partial(self._reply, call_id)
                )
                continue
            future = core_loop.submit(partial(commands[kind], *args))
            if kind == "add":
                future.add_done_callback(partial(self._reject, args[0]))
            elif call_id is not None:
                future.add_done_callback(partial(self._reply, call_id))

    def _update(self, call_id: int, path: str, version: int | None) -> None:
        """Read the checkpoint on a thread of its own (commands keep flowing), then queue it."""
        try:
            done = self.core_loop.update_weights(Path(path), version)
        except Exception as e:
            done = Future()
            done.set_exception(e)
        done.add_done_callback(partial(self._reply, call_id))

    def _reply(self, call_id: int, future: Future) -> None:
        error = future.exception()
        self._answer(call_id, error is None, future.result() if error is None else _portable(error))

    def _answer(self, call_id: int, ok: bool, value: Any) -> None:
        with contextlib.suppress(OSError):  # the server has gone
            self.send_with_stats("reply", call_id, ok, value)

    def _reject(self, request_id: str, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self.rejected.append((request_id, str(error)))


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error, protocol=5))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
