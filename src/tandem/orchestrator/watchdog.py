"""Event-loop watchdog: a warning when synchronous code blocks the orchestrator's event loop.

Every rollout, request to the inference servers, weight update and metrics forwarder of the
orchestrator (and of `evaluate`) shares one event loop. Synchronous code that blocks it inside
async code (a `requests.get`, a `time.sleep`, a CPU-heavy loop in an environment's `async def`)
freezes all of them, and from outside the run only looks slow or stuck. The watchdog makes such
a stall visible: the loop runs one tiny callback every `interval_s`; a daemon thread checks that
it keeps running, and once a tick is more than `threshold_s` late it logs one warning naming what
the loop's thread is running at that moment (its innermost frames: file:line in function) and
how long the loop has been blocked. When the loop runs again it logs the stall's whole length,
once. A healthy loop costs one callback and one thread wake-up per interval, and logs nothing.

What it does not do: it cannot interrupt the blocked code (nothing in Python can preempt the
loop's thread), so the stall goes on until that code returns; the fix is to move the blocking
work off the loop (`asyncio.to_thread`, `loop.run_in_executor`, `Environment.score_all`). The
stack is sampled once per stall, when the threshold passes: a stall made of many short blocking
calls shows the one running then. Code that blocks while holding the GIL (some C extensions)
also keeps the watchdog's thread from running: such a stall, like one that ends between two
checks, is reported only when it ends, with its length but not its place.
"""

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator

log = logging.getLogger(__name__)

STALL_THRESHOLD_S = 2.0
"""A stall worth a warning. A healthy loop runs each callback in milliseconds, and a garbage
collection pauses it for well under a second: 2 s of silence means something really holds the
loop (the orchestrator's own synchronous work, packing and writing a very large step, can too:
then the warning names that). It is short enough that the warning comes long before the stall
makes requests time out (`client.request_timeout`) or groups fail (`rollout_timeout`), which
would blame the servers or the environment's slowness instead of the blocking call."""
TICK_INTERVAL_S = 0.5
"""How often the loop ticks and the thread checks: a stall is reported at most this late."""
FRAMES = 6
"""Innermost frames of the loop's thread a warning names (the blocking call and its callers)."""


ASYNCIO = os.path.dirname(asyncio.__file__) + os.sep


def describe_stack(thread_id: int, depth: int = FRAMES) -> str:
    """The innermost `depth` frames of a thread, innermost first: 'file:line in function < ...',
    up to the event loop's own frames (the callback or task step that runs them)."""
    frame = sys._current_frames().get(thread_id)
    places = []
    while frame is not None and len(places) < depth:
        code = frame.f_code
        if places and code.co_filename.startswith(ASYNCIO):
            break
        places.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return " < ".join(places) or "(no Python frames)"


class LoopWatchdog:
    """Watches one event loop; `start` and `stop` on that loop's thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        threshold_s: float = STALL_THRESHOLD_S,
        interval_s: float = TICK_INTERVAL_S,
    ) -> None:
        self.loop = loop
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.due = 0.0
        """When the next tick should run (time.monotonic)."""
        self.reported = False
        """The stall going on now was warned about."""
        self.ended: list[tuple[float, bool]] = []
        """Stalls the loop came back from, not logged yet: (seconds, whether they were reported)."""
        self.handle: asyncio.TimerHandle | None = None
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.loop_thread = 0

    def start(self) -> None:
        self.loop_thread = threading.get_ident()
        self.due = time.monotonic() + self.interval_s
        self.handle = self.loop.call_later(self.interval_s, self.tick)
        self.thread = threading.Thread(target=self.watch, name="event-loop-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.handle is not None:
            self.handle.cancel()
        if self.thread is not None:
            self.thread.join(timeout=1.0)
        self.log_ended()

    def tick(self) -> None:
        """On the loop: note that it ran, and a stall it came back from; never raises."""
        try:
            now = time.monotonic()
            with self.lock:
                late = now - self.due
                if late > self.threshold_s or self.reported:
                    self.ended.append((late, self.reported))
                self.reported = False
                self.due = now + self.interval_s
            if not self.stopping.is_set():
                self.handle = self.loop.call_later(self.interval_s, self.tick)
        except Exception:  # e.g. the loop closing: the watchdog stops, the loop goes on
            log.debug("event-loop watchdog stopped ticking", exc_info=True)

    def watch(self) -> None:
        """On the watchdog's thread: warn once per stall, and log each stall's end."""
        while not self.stopping.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # a watchdog must not take anything down with it
                log.debug("event-loop watchdog check failed", exc_info=True)

    def check(self) -> None:
        if self.loop.is_closed():
            self.stopping.set()
            return
        stack = None
        with self.lock:
            blocked = time.monotonic() - self.due
            if blocked > self.threshold_s and not self.reported and self.loop.is_running():
                self.reported = True
                stack = describe_stack(self.loop_thread)
        self.log_ended()
        if stack is not None:
            log.warning(
                "the event loop has been blocked for %.1fs, running %s; every rollout, server "
                "request and weight update waits meanwhile. Run blocking calls in async code "
                "(an environment's too) with asyncio.to_thread(...) or loop.run_in_executor(...)",
                blocked,
                stack,
            )

    def log_ended(self) -> None:
        with self.lock:
            ended, self.ended = self.ended, []
        for seconds, reported in ended:
            if reported:
                log.warning("the event loop ran again after being blocked for %.1fs", seconds)
            else:  # it ended before the next check, or its code held the GIL and kept the thread out
                log.warning(
                    "the event loop was blocked for %.1fs; what blocked it was not seen (it ended "
                    "before the watchdog looked, or held the GIL meanwhile)",
                    seconds,
                )


@contextlib.asynccontextmanager
async def watch_event_loop(
    threshold_s: float = STALL_THRESHOLD_S, interval_s: float = TICK_INTERVAL_S
) -> AsyncIterator[LoopWatchdog]:
    """A LoopWatchdog on the running loop for the duration of the block."""
    watchdog = LoopWatchdog(asyncio.get_running_loop(), threshold_s, interval_s)
    watchdog.start()
    try:
        yield watchdog
    finally:
        watchdog.stop()
