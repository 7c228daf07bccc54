"""`sft @ config.toml [--key value ...]`, single process or under torchrun."""

from tandem.cli import run_cli
from tandem.config.loader import parse_config
from tandem.trainer.sft.config import SFTConfig


def main() -> None:
    run_cli(lambda: _run(), "sft")


def _run() -> None:
    from tandem.trainer.sft.train import train

    train(parse_config(SFTConfig, prog="sft"))


if __name__ == "__main__":
    main()
