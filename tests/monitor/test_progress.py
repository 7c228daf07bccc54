"""The plain progress lines (no TTY: logs, the launcher's prefixed output) name each step as the
process's metrics.jsonl records do."""

import pytest

from tandem.monitor.progress import TrainingProgress


def lines_of(capsys: pytest.CaptureFixture, total: int, start: int = 0, **kwargs: bool) -> list[str]:
    """The step part of each line, the updates made as the RL trainer and orchestrator make them:
    `update(step + 1)` once step `step` (its records' `step`) is done."""
    with TrainingProgress(total, start, log_interval=1, **kwargs) as progress:
        for step in range(start, total):
            progress.update(step + 1, {"loss": 0.5})
    return [line.split("  ")[0] for line in capsys.readouterr().out.splitlines()]


def test_rl_lines_name_the_step_of_the_record_and_count_the_steps_done(
    capsys: pytest.CaptureFixture,
) -> None:
    """A run of max_steps = 3 has records of steps 0, 1, 2; its last line shows 3/3 done (was
    `step 3/3` beside a last record of step 2)."""
    assert lines_of(capsys, 3, index_steps=True) == ["step 0 (1/3)", "step 1 (2/3)", "step 2 (3/3)"]
    assert lines_of(capsys, 4, start=2, index_steps=True) == ["step 2 (3/4)", "step 3 (4/4)"]  # resumed


def test_sft_lines_count_steps_done_as_its_records_do(capsys: pytest.CaptureFixture) -> None:
    assert lines_of(capsys, 2) == ["step 1/2", "step 2/2"]
