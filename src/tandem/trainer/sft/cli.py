"""`sft @ config.toml [--key value ...]`, single process or under torchrun."""

from tandem.trainer.torchrun_rank import die_with_torchrun_agent

die_with_torchrun_agent()  # (first: a rank whose agent is killed while it imports must go too)

from tandem.cli import run_cli  # noqa: E402
from tandem.config.loader import parse_config  # noqa: E402
from tandem.trainer.sft.config import SFTConfig  # noqa: E402


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
