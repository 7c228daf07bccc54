"""`uv run orchestrator @ rl.toml [--resume]`: produce rollouts for the trainer from inference servers."""

import asyncio
import logging

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
    asyncio.run(Orchestrator(cfg).run())


def main() -> None:
    run_cli(lambda: run(parse_config(OrchestratorConfig, prog="orchestrator")), "orchestrator")


if __name__ == "__main__":  # the rl launcher starts it with python -m
    main()
