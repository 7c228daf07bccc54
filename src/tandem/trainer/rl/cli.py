"""`trainer @ config.toml [--key value ...] [--resume]`, single process or under torchrun."""

from tandem.trainer.torchrun_rank import die_with_torchrun_agent

die_with_torchrun_agent()  # (first: a rank whose agent is killed while it imports must go too)

from tandem.cli import UserError, run_cli  # noqa: E402
from tandem.config.loader import parse_config  # noqa: E402
from tandem.trainer.rl.config import RLTrainerConfig  # noqa: E402


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
