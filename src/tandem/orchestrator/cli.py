"""`uv run orchestrator @ rl.toml [--resume]`: produce rollouts for the trainer from inference servers."""

import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any

from tandem.cli import run_cli
from tandem.config.loader import parse_config
from tandem.orchestrator.config import OrchestratorConfig


def run(cfg: OrchestratorConfig) -> None:
    from tandem.orchestrator.loop import Orchestrator  # torch and transformers: only once the config is valid

    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s orchestrator: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpx2", "openai"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(until_sigterm(Orchestrator(cfg).run()))


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
