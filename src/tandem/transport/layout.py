"""The run directory's step folders, without torch (the launcher and the orchestrator read them).

    run_dir/rollouts/step_N/rank_R.bin + READY   the orchestrator's batches (transport/rollouts.py)
    run_dir/weights/step_N/ + STABLE             published policies (transport/weights.py)
    run_dir/checkpoints/step_N/                  the trainer's resumable state (trainer/checkpoint.py)

    run_dir/rl.lock                              held by the `rl` launcher running the run

A step folder counts once its marker exists (READY, STABLE) or, for checkpoints, once it has its
final name (it is written under a temporary one and renamed).

A server loads only complete weights. The orchestrator hands a server weights/step_N (its path)
once it has seen step_N/STABLE, and the server then reads the files one by one for as long as that
takes, without looking at STABLE again; so a STABLE directory must not change while a server may
read it. The invariant: **a published directory is written once and only removed, STABLE first,
once no server can be told to load it.** What keeps it:

- publishing (transport/weights.py) writes step_N under a temporary name, renames it into place
  and adds STABLE last: a STABLE directory is complete;
- a trainer publishes each version once, in increasing order; a resumed run's launcher deletes
  every version past the checkpoint the trainer resumes from before it starts any process
  (transport/resume.py, `drop_weights_to_republish`), so the versions the new trainer publishes
  again are new directories, never rewrites of one that the orchestrator's first sync may have
  handed a server (it takes the newest STABLE version);
- the trainer prunes (weights.keep > max_async_level, STABLE first) only versions older than any
  the servers can be moving to: it runs at most max_async_level + 1 versions ahead of what they
  serve. The orchestrator's own resume deletions come before it tells any server anything.
"""

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from tandem.cli import UserError
from tandem.transport.weights import STEP_DIR

CHECKPOINTS = "checkpoints"
READY = "READY"
LOCK = "rl.lock"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold run_dir/rl.lock (an flock, gone with the process however it ends) for the block;
    UserError naming the holder's pid when another launcher runs the same run_dir (the two
    overwrote each other's configs, and a --resume deleted a live run's steps)."""
    path = Path(run_dir) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise UserError(
                f"run_dir {run_dir} is in use by another rl launcher (pid {holder}); wait for it or "
                "choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


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
