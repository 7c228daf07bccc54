"""http.py's pieces in-process: `until_disconnect` (a whole response's work against its client)."""

import asyncio

import pytest
from starlette.requests import Request

from tandem.inference.http import until_disconnect


def request_with(gone: asyncio.Event) -> Request:
    """A request whose client disconnects when `gone` is set (its body already read)."""

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


class Work:
    """A coroutine that waits for `release`, and records whether it was cancelled and finished."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = self.finished = False

    async def run(self, fail: bool = False) -> str:
        try:
            await self.release.wait()
            if fail:
                raise ValueError("failed")
            return "done"
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.finished = True


def test_the_work_result_and_its_error() -> None:
    async def main() -> None:
        gone, work, failing = asyncio.Event(), Work(), Work()
        work.release.set()
        failing.release.set()
        assert await until_disconnect(request_with(gone), work.run()) == "done"
        with pytest.raises(ValueError, match="failed"):
            await until_disconnect(request_with(gone), failing.run(fail=True))
        assert not work.cancelled and not failing.cancelled

    asyncio.run(main())


def test_a_disconnect_cancels_the_work() -> None:
    async def main() -> None:
        gone, work = asyncio.Event(), Work()
        asyncio.get_running_loop().call_later(0.01, gone.set)
        assert await until_disconnect(request_with(gone), work.run()) is None
        assert work.cancelled and work.finished

    asyncio.run(main())


def test_cancelling_the_caller_cancels_the_work_first() -> None:
    async def main() -> None:
        gone, work = asyncio.Event(), Work()
        caller = asyncio.create_task(until_disconnect(request_with(gone), work.run()))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert work.cancelled and work.finished

    asyncio.run(main())
