"""The run directory's step folders, without torch (the launcher and the orchestrator read them).

    run_dir/rollouts/step_N/rank_R.bin + READY   the orchestrator's batches (transport/rollouts.py)
    run_dir/weights/step_N/ + STABLE             published policies (transport/weights.py)
    run_dir/checkpoints/step_N/                  the trainer's resumable state (trainer/checkpoint.py)

A step folder counts once its marker exists (READY, STABLE) or, for checkpoints, once it has its
final name (it is written under a temporary one and renamed).
"""

import shutil
from pathlib import Path

from tandem.transport.weights import STEP_DIR

CHECKPOINTS = "checkpoints"
READY = "READY"


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}"


def rank_path(run_dir: Path, step: int, rank: int) -> Path:
    return step_dir(run_dir, step) / f"rank_{rank}.bin"


def written_steps(run_dir: Path) -> list[int]:
    """Steps whose rollouts are completely written (their READY marker exists), ascending."""
    root = Path(run_dir) / "rollouts"
    if not root.is_dir():
        return []
    steps = [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / READY).is_file()]
    return sorted(steps)


def prune_steps(run_dir: Path, before: int) -> int:
    """Delete rollouts/step_N for every written N < `before`; returns how many were deleted."""
    old = [step for step in written_steps(run_dir) if step < before]
    for step in old:
        shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)
    return len(old)


def checkpoint_dir(root: Path, step: int) -> Path:
    """The checkpoint of `step` under `root` (run_dir/checkpoints)."""
    return Path(root) / f"step_{step}"


def checkpoint_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root` (run_dir/checkpoints), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name)))
