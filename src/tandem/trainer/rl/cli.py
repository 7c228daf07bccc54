"""`trainer @ config.toml [--key value ...] [--resume]`, single process or under torchrun."""

from tandem.cli import UserError, run_cli
from tandem.config.loader import parse_config
from tandem.trainer.rl.config import RLTrainerConfig


def main() -> None:
    """Run the trainer; a completed run exits without interpreter finalization (parallel.end_process)."""
    run_cli(_run, "trainer")
    from tandem.trainer.parallel import end_process

    end_process()


def _run() -> None:
    from tandem.trainer.rl.train import train
    from tandem.transport.rollouts import RolloutError

    cfg = parse_config(RLTrainerConfig, prog="trainer")
    try:
        train(cfg)
    except RolloutError as e:  # missing, late or corrupt rollouts: one line, not a traceback
        raise UserError(str(e)) from None


if __name__ == "__main__":
    main()
