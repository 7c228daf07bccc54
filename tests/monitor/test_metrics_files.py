"""Readers of run_dir/metrics.jsonl on what a killed writer leaves: a torn last line is ignored (and
cut off by the next writer), any other bad line is skipped with a warning naming file and line,
and repeated or out-of-order steps plot once each, in step order."""

import logging
from pathlib import Path

import pytest

from tandem.monitor.metrics import MetricsWriter, read_metrics
from tandem.monitor.plot import series

GOOD = '{"step": 0, "source": "trainer", "loss": 1.0}\n{"step": 1, "source": "trainer", "loss": 0.5}\n'


def test_a_torn_last_line_is_ignored_and_a_complete_one_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + '{"step": 2, "source": "tra')
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    path.write_text(GOOD + '{"step": 2, "source": "trainer"}')
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    path.write_text(GOOD + "\n")
    assert [r["step"] for r in read_metrics(path)] == [0, 1]


@pytest.mark.parametrize("bad", ['{"step": 2, "sou', "[1, 2]", '{"source": "trainer"}'])
def test_a_bad_line_before_the_last_is_skipped_naming_file_and_line(
    tmp_path: Path, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + bad + "\n" + '{"step": 3, "source": "trainer"}\n')
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(path)] == [0, 1, 3]
    assert f"skipped {path}:3: " in caplog.text


def test_a_resumed_writer_cuts_off_the_torn_line_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + '{"step": 2, "source": "tra')
    with MetricsWriter(path, "trainer") as writer:
        writer.log(2, loss=0.25)
    records = read_metrics(path)
    assert [(r["step"], r["loss"], r.get("repeated")) for r in records] == [
        (0, 1.0, None),
        (1, 0.5, None),
        (2, 0.25, None),
    ]


def test_plot_series_is_in_step_order_with_the_later_record_of_a_step(tmp_path: Path) -> None:
    records = [{"step": 2, "r": 0.3}, {"step": 0, "r": 0.1}, {"step": 1, "r": 0.2}, {"step": 1, "r": 0.9}]
    assert series(records, "r") == ([0, 1, 2], [0.1, 0.9, 0.3])
