"""`trainer @ config.toml [--key value ...] [--resume]`, single process or under torchrun."""

from tandem.cli import run_cli
from tandem.config.loader import parse_config
from tandem.trainer.rl.config import RLTrainerConfig


def main() -> None:
    run_cli(_run, "trainer")


def _run() -> None:
    from tandem.trainer.rl.train import train

    train(parse_config(RLTrainerConfig, prog="trainer"))


if __name__ == "__main__":
    main()
