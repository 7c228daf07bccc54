"""Where a resumed run starts: after its checkpoint, reusing the rollouts in an unbroken line from
it, and discarding what the stopped run left beyond that (so no server gets a policy from the future)."""

from pathlib import Path

import pytest

from tandem.cli import UserError
from tandem.config import build_config
from tandem.launch.cli import prepare_resume
from tandem.launch.config import RLConfig
from tandem.launch.plan import plan_run
from tandem.monitor.metrics import MetricsWriter, read_metrics
from tandem.transport.layout import written_steps
from tandem.transport.resume import check_fresh_start, orchestrator_start, trainer_start
from tandem.transport.weights import STABLE, stable_versions


def stopped_run(run_dir: Path, rollouts: list[int], weights: list[int], checkpoints: list[int]) -> Path:
    for step in rollouts:
        (run_dir / "rollouts" / f"step_{step}").mkdir(parents=True)
        (run_dir / "rollouts" / f"step_{step}" / "READY").write_text("{}")
    for version in weights:
        (run_dir / "weights" / f"step_{version}").mkdir(parents=True)
        (run_dir / "weights" / f"step_{version}" / STABLE).write_text("{}")
    for step in checkpoints:
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run_dir / "checkpoints" / ".tmp_step_99").mkdir(parents=True)  # an unfinished one: ignored
    return run_dir


def test_stopped_before_the_first_checkpoint_it_retrains_on_its_rollouts(tmp_path: Path) -> None:
    run_dir = stopped_run(tmp_path, rollouts=[0, 1, 2], weights=[1, 2], checkpoints=[])
    with pytest.raises(UserError, match=r"up to step 2: pass --resume to continue that run \(from step 0"):
        check_fresh_start(run_dir)
    assert trainer_start(run_dir) == 0
    assert orchestrator_start(run_dir) == 3
    assert written_steps(run_dir) == [0, 1, 2] and stable_versions(run_dir) == [1, 2]


def test_rollouts_pruned_without_checkpoints_start_over(tmp_path: Path) -> None:
    run_dir = stopped_run(tmp_path, rollouts=[4], weights=[4, 5], checkpoints=[])
    assert orchestrator_start(run_dir) == 0
    assert written_steps(run_dir) == [] and stable_versions(run_dir) == []
    assert not (run_dir / "weights" / "step_5").exists()


def test_after_a_checkpoint_it_continues_and_drops_what_lies_past_a_gap(tmp_path: Path) -> None:
    run_dir = stopped_run(tmp_path, rollouts=[3, 4, 5, 7], weights=[4, 5, 6, 8], checkpoints=[2, 4])
    assert trainer_start(run_dir) == 4
    assert orchestrator_start(run_dir) == 6
    assert written_steps(run_dir) == [3, 4, 5] and stable_versions(run_dir) == [4, 5, 6]


def test_steps_packed_for_another_trainer_shape_are_collected_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Resumed on another number of trainer ranks: kept rollouts from the checkpoint on were packed
    for the old data-parallel groups (the trainer would refuse them), so they are written again."""
    run_dir = stopped_run(tmp_path, rollouts=[3, 4, 5], weights=[4, 5], checkpoints=[4])
    for step in (3, 4, 5):
        (run_dir / "rollouts" / f"step_{step}" / "READY").write_text('{"num_ranks": 2, "cp": 1}')
    assert orchestrator_start(run_dir, (2, 1)) == 6  # the same trainer: all kept
    assert written_steps(run_dir) == [3, 4, 5] and not caplog.records
    assert orchestrator_start(run_dir, (1, 1)) == 4  # now one rank: steps 4 and 5 again
    assert written_steps(run_dir) == [3] and stable_versions(run_dir) == [4]  # (step 3 is never read again)
    assert "rollouts of steps 4.. were packed for (data-parallel groups, cp) = (2, 1)" in caplog.text


def test_the_launcher_deletes_the_weights_the_resumed_trainer_publishes_again(tmp_path: Path) -> None:
    """Checkpoint 4, rollouts of steps 4 and 5 kept: the orchestrator starts at 6, and its first sync
    hands the servers the newest STABLE version. That was the stopped run's step_6 (or step_5),
    which the new trainer, retraining steps 4 and 5, then rewrote in place while the servers read
    it (some shards of each version). Before any process starts, `rl` deletes every version past
    the checkpoint: the servers start from step_4, which nobody writes again."""
    run_dir = stopped_run(tmp_path / "run", rollouts=[3, 4, 5], weights=[3, 4, 5, 6], checkpoints=[4])
    for step in (3, 4, 5):  # packed for the one trainer rank the plan has
        (run_dir / "rollouts" / f"step_{step}" / "READY").write_text('{"num_ranks": 1, "cp": 1}')
    overrides = [("model.name", "tiny"), ("run_dir", str(run_dir)), ("resume", True)]
    prepare_resume(plan_run(build_config(RLConfig, overrides=overrides), []))
    assert stable_versions(run_dir) == [3, 4] and sorted(p.name for p in (run_dir / "weights").iterdir()) == [
        "step_3",
        "step_4",
    ]
    assert written_steps(run_dir) == [3, 4, 5] and orchestrator_start(run_dir) == 6  # the kept rollouts stay


def test_metrics_of_repeated_steps_are_marked_per_attempt(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for steps in ([0, 1, 2], [1, 2, 3], [3, 4]):  # a run, resumed from step 1, then from step 3
        with MetricsWriter(path, "trainer") as writer:
            for step in steps:
                writer.log(step, loss=float(step))
    marks = [(r["step"], r.get("attempt", 1)) for r in read_metrics(path)]
    assert marks == [(0, 1), (1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (3, 3), (4, 1)]
    latest = [(r["step"], r.get("attempt", 1)) for r in read_metrics(path, latest=True)]
    assert latest == [(0, 1), (1, 2), (2, 2), (3, 3), (4, 1)]
