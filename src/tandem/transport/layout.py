"""The run directory's step folders, without torch (the launcher and the orchestrator read them).

    run_dir/rollouts/step_N/rank_R.bin + READY   the orchestrator's batches (transport/rollouts.py)
    run_dir/weights/step_N/ + STABLE             published policies (transport/weights.py)
    run_dir/checkpoints/step_N/                  the trainer's resumable state (trainer/checkpoint.py)

    run_dir/rl.lock                              held by the `rl` launcher running the run and its processes

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
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tandem.cli import UserError
from tandem.transport.weights import STEP_DIR

CHECKPOINTS = "checkpoints"
READY = "READY"
LOCK = "rl.lock"


LOCK_WAIT_S = 60.0
"""How long a launcher waits for the processes that a killed launcher of the same run_dir left
(the kernel sent them SIGTERM when it died; they hold its lock until they have exited)."""


@contextlib.contextmanager
def run_dir_lock(
    run_dir: Path, wait_s: float = LOCK_WAIT_S, say: Callable[[str], None] | None = None
) -> Iterator[int]:
    """Hold run_dir/rl.lock (an flock) for the block; yields its descriptor, which the launcher
    passes to the run's processes: the lock is free once the launcher and all of them have exited,
    however each ends. UserError naming the holder's pid when another launcher runs the same
    run_dir (the two overwrote each other's configs, and a --resume deleted a live run's steps).
    When only the processes of a launcher that is gone (SIGKILLed) hold it, waits up to `wait_s`
    for them to exit (a resume that started beside them deleted steps they were still writing,
    or found their GPUs and ports still taken), then UserError naming them."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"run_dir {run_dir}: cannot write {path}: {e.strerror}") from None
    try:
        _take_lock(fd, path, wait_s, say)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # (a full disk: before anything else in run_dir is written)
            raise UserError(f"run_dir {run_dir}: cannot write {path}: {e.strerror}") from None
        yield fd
    finally:
        os.close(fd)


def _take_lock(fd: int, path: Path, wait_s: float, say: Callable[[str], None] | None) -> None:
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        holders = lock_holders(path)  # (this process among them: it opened the file too)
        if holder.isdigit() and (int(holder) in holders if len(holders) > 1 else _running(int(holder))):
            raise UserError(
                f"run_dir {path.parent} is in use by another rl launcher (pid {holder}); wait for it or "
                "choose another run_dir"
            )
        left = ", ".join(f"{pid} ({cmd})" for pid, cmd in holders.items() if pid != os.getpid())
        launcher = f"the rl launcher (pid {holder or 'unknown'})"
        if time.monotonic() >= deadline:
            raise UserError(
                f"run_dir {path.parent} is still locked by processes {launcher} left when it was killed: "
                f"{left or 'not visible to this user'}; they were sent SIGTERM when it died: stop them "
                f"(kill PID) or wait, then run again"
            )
        if not told and say is not None and holder:
            say(f"{launcher} is gone; waiting up to {wait_s:g} s for the processes it left to exit: {left}")
            told = True
        time.sleep(0.2)


def lock_holders(path: Path) -> dict[int, str]:
    """pid → command line of each process (of those this user may inspect) with `path` open (Linux)."""
    target = str(Path(path).resolve())
    found = {}
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if pid.isdigit() and any(
            _link(f"/proc/{pid}/fd/{fd}") == target for fd in _listdir(f"/proc/{pid}/fd")
        ):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # (gone meanwhile)
                continue
            found[int(pid)] = cmd.strip()[:100]
    return found


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # another user's process, or gone
        return []


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
