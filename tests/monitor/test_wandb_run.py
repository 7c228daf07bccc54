"""The W&B run the orchestrator writes (the real wandb package, offline): metrics.jsonl records of
every source under `<source>/<key>`, a resumed run continuing the same W&B run with only the
records it had not sent, and a bounded wait for the trainer's last step."""

import asyncio
import json
import logging
from pathlib import Path

import pytest
from wandb_offline import history, keep_wandb_home_in, offline_runs, records

from tandem.monitor.config import WandbConfig
from tandem.monitor.metrics import MetricsWriter
from tandem.monitor.wandb_run import WandbRun

pytest.importorskip("wandb", reason="the wandb extra (uv sync --extra wandb)")


def test_a_resumed_run_continues_the_same_wandb_run_without_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keep_wandb_home_in(tmp_path / "home", monkeypatch)
    cfg = WandbConfig(mode="offline", project="p", name="run")
    run_dir = tmp_path / "run"
    trainer = MetricsWriter(run_dir / "metrics.jsonl", "trainer")
    trainer.log(0, loss=1.0)
    first = WandbRun(cfg, run_dir, resume=False, config={"lr": 0.1}, poll_s=0.01)
    with caplog.at_level(logging.WARNING):
        asyncio.run(first.wait_for("trainer", 1, timeout_s=0.2))  # step 1 never comes
    assert "no trainer metrics for step 1" in caplog.text
    first.finish(failed=True)
    trainer.log(1, loss=0.5)  # written while no orchestrator ran
    MetricsWriter(run_dir / "metrics.jsonl", "orchestrator").log(2, reward_mean=0.25)
    second = WandbRun(cfg, run_dir, resume=True, config={"lr": 0.1}, poll_s=0.01)
    asyncio.run(second.wait_for("trainer", 1, timeout_s=10))
    second.finish(failed=False)
    assert second.run.id == first.run.id

    runs = offline_runs(run_dir)
    assert len(runs) == 2  # one directory per orchestrator attempt, both of run `first.run.id`
    logged = records(runs[1])  # the first attempt's records are the plain forwarding other tests read
    rows = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history(logged)]
    assert rows == [
        {"trainer/step": 1, "trainer/loss": 0.5},
        {"orchestrator/step": 2, "orchestrator/reward_mean": 0.25},
    ]
    (run,) = [r["run"] for r in logged if r["type"] == "run"]
    assert run["run_id"] == first.run.id and run["resume"] is True
    assert [r["exit"]["exit_code"] for r in logged if r["type"] == "exit"] == [0]


def test_the_forwarder_skips_a_bad_line_naming_it_and_waits_for_a_torn_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keep_wandb_home_in(tmp_path / "home", monkeypatch)
    run_dir = tmp_path / "run"
    MetricsWriter(run_dir / "metrics.jsonl", "trainer").log(0, loss=1.0)
    path = run_dir / "metrics.jsonl"
    with path.open("a") as f:  # a bad line, a blank one, a resumed run's record, a torn last line
        f.write('[1]\n\n{"step": 1, "source": "trainer", "repeated": true, "attempt": 2, "loss": 0.4}\n{"st')
    run = WandbRun(WandbConfig(mode="offline", project="p"), run_dir, resume=False, config={}, poll_s=0.01)
    with caplog.at_level(logging.WARNING):
        asyncio.run(run.wait_for("trainer", 1, timeout_s=10))
    run.finish(failed=False)
    assert f"skipped {path}:2: not a metrics record" in caplog.text
    (offline,) = offline_runs(run_dir)
    rows = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history(records(offline))]
    assert rows == [{"trainer/step": 0, "trainer/loss": 1.0}, {"trainer/step": 1, "trainer/loss": 0.4}]


def test_after_a_kill_a_resume_sends_the_last_poll_again_rather_than_lose_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """forwarded.json lags one poll behind what was handed to W&B (whose process writes it a
    moment later) until the run finishes: records handed over just before a kill were skipped by
    the resumed forwarder, and W&B never had them."""
    keep_wandb_home_in(tmp_path / "home", monkeypatch)
    run_dir = tmp_path / "run"
    trainer = MetricsWriter(run_dir / "metrics.jsonl", "trainer")
    state = run_dir / "wandb" / "forwarded.json"
    run = WandbRun(WandbConfig(mode="offline", project="p"), run_dir, resume=False, config={}, poll_s=0.01)
    trainer.log(0, loss=1.0)
    run.forward_new()
    after_first = (run_dir / "metrics.jsonl").stat().st_size
    assert json.loads(state.read_text())["offset"] == 0  # handed over, maybe not yet written
    trainer.log(1, loss=0.5)
    run.forward_new()
    assert json.loads(state.read_text())["offset"] == after_first
    run.finish(failed=False)
    assert json.loads(state.read_text())["offset"] == (run_dir / "metrics.jsonl").stat().st_size
