"""`uv run orchestrator @ rl.toml [--resume]`: produce rollouts for the trainer from inference servers."""

import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

from tandem.cli import run_cli
from tandem.config.loader import parse_config
from tandem.orchestrator.config import OrchestratorConfig

T = TypeVar("T")
SHUTDOWN_GRACE_S = 5.0
"""How long the process's end waits for tasks still running once they are cancelled. asyncio.run
waits without limit, so one environment rollout that ignores cancellation (abandoned by
`play_group`) kept a finished orchestrator from ever exiting."""


def run(cfg: OrchestratorConfig) -> None:
    from tandem.orchestrator.loop import Orchestrator  # torch and transformers: only once the config is valid

    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s orchestrator: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpx2", "openai"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    run_async(until_sigterm(Orchestrator(cfg).run()))


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), Ctrl-C handling included, but its shutdown waits at most
    SHUTDOWN_GRACE_S for the tasks still running (cancelled first, as asyncio.run does), then logs
    the names of those that ignored it and closes the loop without them."""
    runner = asyncio.Runner()
    loop = runner.get_loop()
    try:
        return runner.run(main)
    finally:
        try:
            loop.run_until_complete(cancel_remaining())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:  # not runner.close(): it would wait for every task again, without limit
            asyncio.set_event_loop(None)
            loop.close()


async def cancel_remaining() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_S)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            asyncio.get_running_loop().call_exception_handler(
                {
                    "message": "unhandled exception during shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )
    if pending:
        logging.getLogger(__name__).warning(
            "exiting without %d task(s) that ignored cancellation for %gs: %s",
            len(pending),
            SHUTDOWN_GRACE_S,
            ", ".join(sorted(t.get_name() for t in pending)),
        )


async def until_sigterm(work: Coroutine[Any, Any, None]) -> None:
    """Run `work`; SIGTERM (how `rl` stops its processes) cancels it, so that its cleanup runs (the
    W&B run is finished and keeps its last records), then exits with 143."""
    task = asyncio.ensure_future(work)
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)
    try:
        await task
    except asyncio.CancelledError:
        if terminated:
            logging.getLogger(__name__).warning("stopped by SIGTERM")
            raise SystemExit(128 + signal.SIGTERM) from None
        raise


def main() -> None:
    run_cli(lambda: run(parse_config(OrchestratorConfig, prog="orchestrator")), "orchestrator")


if __name__ == "__main__":  # the rl launcher starts it with python -m
    main()
