"""The event-loop watchdog on a real loop: synchronous code that blocks the loop is reported with
where it blocks and for how long; a healthy loop is reported nothing."""

import asyncio
import logging
import re
import time

import pytest

from tandem.orchestrator import watchdog
from tandem.orchestrator.watchdog import watch_event_loop

THRESHOLD_S = 0.3
INTERVAL_S = 0.05


async def rollout_that_blocks() -> None:
    time.sleep(3 * THRESHOLD_S)  # the mistake the watchdog reports: blocking in async code


def test_a_blocked_loop_is_reported_with_the_blocking_code_and_the_stall_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, such a stall froze every rollout, request and heartbeat and nothing said why."""

    async def main() -> None:
        async with watch_event_loop(THRESHOLD_S, INTERVAL_S):
            await asyncio.sleep(0.2)
            await rollout_that_blocks()
            await asyncio.sleep(0.2)

    with caplog.at_level(logging.WARNING, logger=watchdog.__name__):
        asyncio.run(main())
    assert len(caplog.messages) == 2, caplog.messages
    blocked, ended = caplog.messages
    line = rollout_that_blocks.__code__.co_firstlineno + 1
    match = re.fullmatch(
        rf"the event loop has been blocked for (\d+\.\d)s, running {re.escape(__file__)}:{line} in "
        rf"rollout_that_blocks < {re.escape(__file__)}:\d+ in main; every rollout, server request "
        r"and weight update waits meanwhile\. Run blocking calls in async code \(an environment's "
        r"too\) with asyncio\.to_thread\(\.\.\.\) or loop\.run_in_executor\(\.\.\.\)",
        blocked,
    )
    assert match, blocked
    assert THRESHOLD_S <= float(match[1]) < 3 * THRESHOLD_S
    match = re.fullmatch(r"the event loop ran again after being blocked for (\d+\.\d)s", ended)
    assert match, ended
    assert 3 * THRESHOLD_S - INTERVAL_S - 0.05 <= float(match[1]) < 3 * THRESHOLD_S + 0.5


def test_a_healthy_loop_is_reported_nothing_and_the_watchdog_stops_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def work(i: int) -> int:
        for _ in range(20):
            await asyncio.sleep(0.01 * (i % 3))
            sum(range(1000))  # short synchronous work between awaits is what a loop is for
        return i

    async def main() -> watchdog.LoopWatchdog:
        async with watch_event_loop(THRESHOLD_S, INTERVAL_S) as dog:
            assert dog.thread is not None and dog.thread.is_alive()
            assert await asyncio.gather(*(work(i) for i in range(50))) == list(range(50))
            await asyncio.sleep(4 * THRESHOLD_S)  # idle: waiting is not blocking
        return dog

    with caplog.at_level(logging.DEBUG, logger=watchdog.__name__):
        dog = asyncio.run(main())
    assert caplog.messages == []
    assert dog.thread is not None and not dog.thread.is_alive()
