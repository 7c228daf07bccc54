"""Where a run in an existing run_dir starts: the one rule the trainer and the orchestrator share.

    run_dir/checkpoints/step_N/, rollouts/step_N/READY, weights/step_N/STABLE (transport/layout.py)

Without --resume a run_dir that holds rollouts is refused (nothing of a run is overwritten by
accident). With --resume:

- the trainer starts at its latest checkpoint K, or at step 0 from the base model when the run
  stopped before its first checkpoint (`trainer_start`);
- the orchestrator continues after the rollouts written in an unbroken line from step K: they
  are still valid input for the steps the trainer retrains (unless packed for another number of
  trainer ranks: resumed on other ranks, those are collected again). Rollouts after a gap, and weights
  newer than the step the orchestrator starts at, came from the stopped run's later policies and
  are deleted before anything is written (`orchestrator_start`), so no server is ever handed a
  policy the new trainer has not produced;
- the launcher, before it starts any process, also deletes every published version newer than
  the trainer's checkpoint (`drop_weights_to_republish`): the new trainer publishes each of them
  again, and rewriting weights/step_N in place while a server loads it (the orchestrator's first
  sync takes the newest STABLE one) gave that server some files of the old directory and some of
  the new. So a published directory is never written twice (transport/layout.py). The
  orchestrator cannot repeat this deletion at its own start: by then the new trainer may have
  published the first of them.

Metrics of retrained steps are marked in metrics.jsonl (monitor/metrics.py).
"""

import json
import logging
import shutil
from pathlib import Path

from tandem.cli import UserError
from tandem.transport.layout import CHECKPOINTS, READY, checkpoint_steps, step_dir, written_steps
from tandem.transport.weights import remove_weights, stable_versions

log = logging.getLogger(__name__)


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


def packed_for(run_dir: Path, step: int) -> tuple[int, int] | None:
    """(data-parallel groups, cp) a written step was packed for (its READY marker), or None."""
    try:
        marker = json.loads((step_dir(run_dir, step) / READY).read_text())
        return int(marker["num_ranks"]), int(marker.get("cp", 1))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def orchestrator_start(run_dir: Path, shape: tuple[int, int] | None = None) -> int:
    """The first step a resumed orchestrator writes; deletes what the stopped run left after it.

    `shape` (data-parallel groups, cp) is the trainer's now: a kept step packed for another (the
    run resumed on another number of trainer ranks) is not valid input and is collected again."""
    written = set(written_steps(run_dir))
    start = trainer_start(run_dir)
    while start in written and (shape is None or packed_for(run_dir, start) == shape):
        start += 1
    if shape is not None and start in written:
        log.warning(
            "rollouts of steps %d.. were packed for (data-parallel groups, cp) = %s; the trainer "
            "now runs %s: collecting them again",
            start,
            packed_for(run_dir, start),
            shape,
        )
    for step in sorted(s for s in written if s >= start):
        shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)
    for version in stable_versions(run_dir):
        if version > start:
            remove_weights(run_dir, version)
    return start


def drop_weights_to_republish(run_dir: Path) -> list[int]:
    """Delete weights/step_N (STABLE first) for every N past the trainer's start: the versions a
    resumed trainer publishes again. Only before any process of the resumed run starts (a trainer
    already running may have published the first of them). Returns the versions deleted."""
    start = trainer_start(run_dir)
    dropped = [version for version in stable_versions(run_dir) if version > start]
    for version in dropped:
        remove_weights(run_dir, version)
    return dropped
