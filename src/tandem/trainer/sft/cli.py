"""`sft @ config.toml [--key value ...]`, single process or under torchrun."""

from tandem.cli import run_cli
from tandem.config.loader import parse_config
from tandem.trainer.sft.config import SFTConfig


def main() -> None:
    """Run the trainer; a completed run exits without interpreter finalization (parallel.end_process)."""
    run_cli(_run, "sft")
    from tandem.trainer.parallel import end_process

    end_process()


def _run() -> None:
    from tandem.trainer.sft.train import train

    train(parse_config(SFTConfig, prog="sft"))


if __name__ == "__main__":
    main()
