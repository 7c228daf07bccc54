"""Where a run in an existing run_dir starts: the one rule the trainer and the orchestrator share.

    run_dir/checkpoints/step_N/, rollouts/step_N/READY, weights/step_N/STABLE (transport/layout.py)

Without --resume a run_dir that holds rollouts is refused (nothing of a run is overwritten by
accident). With --resume:

- the trainer starts at its latest checkpoint K, or at step 0 from the base model when the run
  stopped before its first checkpoint (`trainer_start`);
- the orchestrator continues after the rollouts written in an unbroken line from step K: they
  are still valid input for the steps the trainer retrains. Rollouts after a gap, and weights
  newer than the step the orchestrator starts at, came from the stopped run's later policies and
  are deleted before anything is written (`orchestrator_start`), so no server is ever handed a
  policy the new trainer has not produced. Weights the trainer publishes again replace the old ones.

Metrics of retrained steps are marked in metrics.jsonl (monitor/metrics.py).
"""

import shutil
from pathlib import Path

from tandem.cli import UserError
from tandem.transport.layout import CHECKPOINTS, checkpoint_steps, step_dir, written_steps
from tandem.transport.weights import STABLE, stable_versions, weights_dir


def trainer_start(run_dir: Path) -> int:
    """The step a resumed trainer trains next: its latest checkpoint's, else 0."""
    steps = checkpoint_steps(Path(run_dir) / CHECKPOINTS)
    return steps[-1] if steps else 0


def check_fresh_start(run_dir: Path) -> None:
    """A run started without --resume must not reuse a run_dir that holds rollouts."""
    if done := written_steps(run_dir):
        restart = (
            ""
            if checkpoint_steps(Path(run_dir) / CHECKPOINTS)
            else " (from step 0: it has no checkpoint yet)"
        )
        raise UserError(
            f"{run_dir} already holds rollouts up to step {done[-1]}: pass --resume to continue that run"
            f"{restart}, or choose another run_dir"
        )


def orchestrator_start(run_dir: Path) -> int:
    """The first step a resumed orchestrator writes; deletes what the stopped run left after it."""
    written = set(written_steps(run_dir))
    start = trainer_start(run_dir)
    while start in written:
        start += 1
    for step in sorted(s for s in written if s > start):
        shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)
    for version in stable_versions(run_dir):
        if version > start:
            (weights_dir(run_dir, version) / STABLE).unlink(missing_ok=True)  # STABLE first, as pruning does
            shutil.rmtree(weights_dir(run_dir, version), ignore_errors=True)
    return start
