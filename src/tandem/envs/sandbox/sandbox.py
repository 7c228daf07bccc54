"""Run untrusted Python (a model's code) where it can reach nothing of the host and harm nothing.

`await Sandbox(limits).run(source, files)` runs `source` as `main.py` with `files` beside it in
/job, a fresh size-limited directory, and returns exit code, capped stdout/stderr and whether it
timed out. At most `max_concurrent` programs run at once; the event loop is never blocked.

Isolation (`isolation`), chosen once per process and logged:

- `namespaces`: tandem's own set-up from kernel features that need no privileges (user, mount,
  PID, network, IPC, UTS namespaces; locked read-only mounts; no capabilities; no_new_privs;
  seccomp). runner.py says step by step what the program gets.
- `bubblewrap`: the same root and filter, built by bwrap(1) — for machines whose kernel refuses
  tandem's set-up but that have a working (for example setuid) bwrap.
- `auto` (the default): `namespaces` where it works, else `bubblewrap` where it works, else
  SandboxError: it never runs untrusted code with less than one of the two.
- `unsafe-local`: only the seccomp filter and the resource limits, in a host directory: the program
  reads whatever the user can read. For trusted code; asked for in words.

Per program: wall-clock time (SIGKILL to the runner, and with it PID 1 of the namespace: nothing
the program started, in any session, survives), CPU seconds (SIGXCPU, then SIGKILL a second
later), address space per process (RLIMIT_AS), total disk (/job is a tmpfs of `disk_mb`;
RLIMIT_FSIZE per file), open files, captured output (`output_bytes` per stream, the rest read and
dropped), and processes: with `max_processes = 1` (the default) the filter refuses any new
process; above that RLIMIT_NPROC caps processes and threads at `max_tasks`, counted in the
sandbox's own user namespace. Linux does not count host root's processes, so the namespaces mode
runs root's programs as host uid 65534, and modes that cannot (bubblewrap run by root,
unsafe-local) refuse `max_processes > 1`. The environment is PATH, HOME=/job, TMPDIR=/job and
LANG only; stdin is /dev/null. docs/environments.md, "Running untrusted code", says what this
guarantees and what it does not.
"""

import asyncio
import contextlib
import logging
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from tandem.envs.sandbox import runner
from tandem.envs.sandbox.policy import SOCKET_FAMILIES, interpreter_files, seccomp_program

log = logging.getLogger(__name__)
RUNNER = Path(runner.__file__)
KILL_GRACE_S = 2.0  # after SIGKILL, how long to wait for the pipes to close
PROBE_TIMEOUT_S = 30.0

Isolation = Literal["auto", "namespaces", "bubblewrap", "unsafe-local"]
ISOLATED_MODES = ("namespaces", "bubblewrap")


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    """Address space (RLIMIT_AS) of each process; Python itself needs ~30 MB."""
    disk_mb: int = 64
    """Everything written under /job together (its tmpfs size)."""
    file_size_mb: int = 16
    max_processes: int = 1
    """Processes, the program included: 1 refuses fork and clone of processes (seccomp)."""
    max_tasks: int = 32
    """Processes and threads in all (RLIMIT_NPROC in the sandbox's user namespace)."""
    open_files: int = 64
    output_bytes: int = 1_000_000
    """Per stream; more is read and dropped."""

    def __post_init__(self) -> None:
        small = [name for name, value in asdict(self).items() if value < 1 and name != "wall_seconds"]
        if small or self.wall_seconds <= 0:  # a tmpfs of size 0 would even be unlimited
            raise ValueError(f"sandbox limits must be positive: {', '.join(small) or 'wall_seconds'}")

    def rlimits(self, count_processes: bool) -> dict[str, int]:
        mb = 1 << 20
        limits = {
            "RLIMIT_CORE": 0,
            "RLIMIT_CPU": self.cpu_seconds,
            "RLIMIT_AS": self.memory_mb * mb,
            "RLIMIT_FSIZE": self.file_size_mb * mb,
            "RLIMIT_NOFILE": self.open_files,
        }
        return limits | ({"RLIMIT_NPROC": self.max_tasks} if count_processes else {})


@dataclass
class SandboxResult:
    exit_code: int | None
    """The program's exit code (128 + N when killed by signal N); None when timed out."""
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    seconds: float
    isolation: str
    """The mode it ran in: namespaces, bubblewrap or unsafe-local."""
    error: str | None = None
    """Why the sandbox itself failed to set up (then the program never ran)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(RuntimeError):
    """The sandbox cannot run as configured (e.g. no isolation on this machine)."""


class Sandbox:
    def __init__(
        self,
        limits: Limits = Limits(),
        max_concurrent: int = 4,
        isolation: Isolation = "auto",
        socket_families: Sequence[str] = (),
    ) -> None:
        """`socket_families`: those the program may open sockets of (AF_UNIX, AF_INET, AF_INET6)."""
        unknown = set(socket_families) - set(SOCKET_FAMILIES)
        if unknown:
            raise ValueError(f"unknown socket families {sorted(unknown)}; known: {sorted(SOCKET_FAMILIES)}")
        self.limits = limits
        self.max_concurrent = max_concurrent
        self.socket_families = tuple(sorted(socket_families))
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.isolation = choose_isolation(isolation)
        if limits.max_processes > 1 and not counts_processes(self.isolation):
            raise SandboxError(
                f"max_processes = {limits.max_processes} needs a sandbox that can count processes "
                f"(namespaces, or bubblewrap when not run as root), not {self.isolation}; set max_processes = 1"
            )

    def slots(self) -> asyncio.Semaphore:
        """The concurrency limit of the running event loop (a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.max_concurrent))
        return self._slots[1]

    async def run(self, source: str, files: Mapping[str, str] | None = None) -> SandboxResult:
        """Run `source` as main.py in a fresh /job holding `files` (name → text)."""
        files = {**(files or {}), "main.py": source}
        for name in files:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"sandbox file name {name!r} must be a plain file name")
        async with self.slots():
            return await run_job(self.isolation, self.limits, files, self.socket_families)


def counts_processes(mode: str) -> bool:
    """Whether RLIMIT_NPROC holds in `mode`: Linux does not apply it to host uid 0, and only the
    namespaces mode runs root's programs as another host uid (nobody)."""
    return mode == "namespaces" or (mode == "bubblewrap" and os.geteuid() != 0)


def job_config(
    mode: str,
    limits: Limits,
    files: dict[str, str],
    socket_families: tuple[str, ...],
    status_fd: int,
    workdir: str | None,
) -> dict[str, Any]:
    """What the runner needs (sent on its stdin); `workdir`: the host directory of unsafe-local."""
    root = interpreter_files()
    home = workdir or runner.JOB_DIR
    return {
        "mode": mode,
        "limits": asdict(limits),
        "rlimits": limits.rlimits(counts_processes(mode)),
        "files": files,
        "mounts": root.mounts,
        "symlinks": root.symlinks,
        "hidden": root.hidden,
        "python": root.python,
        "bwrap": shutil.which("bwrap") or "bwrap",
        "seccomp": seccomp_program(socket_families, limits.max_processes > 1),
        "ip_sockets": bool({"AF_INET", "AF_INET6"} & set(socket_families)),
        "env": {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"},
        "status_fd": status_fd,
        "parent_pid": os.getpid(),
        "host_uid": os.geteuid(),
        "workdir": workdir,
    }


async def run_job(
    mode: str, limits: Limits, files: dict[str, str], socket_families: tuple[str, ...] = ()
) -> SandboxResult:
    # The runner reports its set-up on its own pipe, which the program never holds: a program
    # cannot pass itself off as a set-up failure (which would fail the rollout instead of scoring it).
    # Everything made here is undone however the run ends, cancelled (a rollout timeout) included.
    status_r, status_w = os.pipe()
    workdir = None
    try:
        workdir = tempfile.mkdtemp(prefix="tandem-sandbox-") if mode == "unsafe-local" else None
        config = job_config(mode, limits, files, socket_families, status_w, workdir)
        start = time.perf_counter()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-B", str(RUNNER), cwd="/", env={},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, pass_fds=(status_w,),
            )  # fmt: skip
        finally:
            os.close(status_w)
        return await supervise(process, config, limits, status_r, start)
    finally:
        os.close(status_r)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


async def supervise(
    process: asyncio.subprocess.Process, config: dict[str, Any], limits: Limits, status_r: int, start: float
) -> SandboxResult:
    assert process.stdin is not None
    cap = limits.output_bytes
    readers = [asyncio.ensure_future(read_capped(s, cap)) for s in (process.stdout, process.stderr)]
    timed_out = False
    try:
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(marshal.dumps(config))
                await process.stdin.drain()
            process.stdin.close()
            await asyncio.wait_for(process.wait(), limits.wall_seconds)
        except TimeoutError:
            timed_out = True
        finally:
            kill(process.pid)  # and with the runner everything inside (PDEATHSIG, PID namespace)
        if process.returncode is None:  # wait() also waits for the pipes (below): not past the grace
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), KILL_GRACE_S)
        done, _ = await asyncio.wait(readers, timeout=KILL_GRACE_S)
    finally:
        for reader in readers:  # something still holds the pipe open, or the run was cancelled
            reader.cancel()
    (out, out_cut), (err, err_cut) = (r.result() if r in done else (b"", True) for r in readers)
    status = read_status(status_r)
    code = process.returncode
    return SandboxResult(
        exit_code=None if timed_out else (128 - code if code is not None and code < 0 else code),
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        timed_out=timed_out,
        output_truncated=out_cut or err_cut,
        seconds=time.perf_counter() - start,
        isolation=config["mode"],
        error=None if status == "ok" else status or "the sandbox runner ended before its set-up finished",
    )


def read_status(fd: int) -> str:
    """What the runner wrote on its status pipe ('ok' or why its set-up failed)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    except BlockingIOError:  # nothing written, and somebody still holds the pipe
        return ""


async def read_capped(stream: asyncio.StreamReader | None, cap: int) -> tuple[bytes, bool]:
    """Everything the stream says up to `cap` bytes, and whether there was more."""
    kept, size = bytearray(), 0
    while stream is not None and (chunk := await stream.read(65536)):
        if size < cap:
            kept += chunk[: cap - size]
        size += len(chunk)
    return bytes(kept), size > cap


def kill(pid: int) -> None:
    for send in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(pid, signal.SIGKILL)


@cache
def probe(mode: str) -> str | None:
    """None when `mode` works on this machine (a real program runs), else why not (one line)."""
    if mode == "bubblewrap" and shutil.which("bwrap") is None:
        return "bwrap is not installed"
    outcome: list[SandboxResult | OSError] = []

    def attempt() -> None:  # in a thread of its own: the caller may be inside an event loop
        try:
            job = run_job(mode, Limits(wall_seconds=PROBE_TIMEOUT_S), {"main.py": "print('ok')"})
            outcome.append(asyncio.run(job))
        except OSError as e:  # e.g. libseccomp missing
            outcome.append(e)

    thread = threading.Thread(target=attempt, name=f"sandbox-probe-{mode}")
    thread.start()
    thread.join()
    result = outcome[0]
    if isinstance(result, OSError):
        return str(result)
    if result.error is not None:
        return result.error.removeprefix("sandbox set-up failed: ")
    if result.stdout != "ok\n":
        return f"a test program did not run (exit code {result.exit_code}: {result.stderr.strip()[-300:]})"
    return None


def isolation_status() -> dict[str, str | None]:
    """Each isolated mode → None when it works here, else why not."""
    return {mode: probe(mode) for mode in ISOLATED_MODES}


@cache
def choose_isolation(isolation: Isolation) -> str:
    """The mode `isolation` resolves to on this machine (logged once), or SandboxError."""
    if isolation == "unsafe-local":
        log.warning("sandbox: isolation = unsafe-local: untrusted code runs with the user's file access")
        return isolation
    candidates = ISOLATED_MODES if isolation == "auto" else (isolation,)
    reasons = {mode: probe(mode) for mode in candidates}
    for mode, reason in reasons.items():
        if reason is None:
            log.info("sandbox: isolation %s (fresh root, locked mounts, no capabilities, seccomp)", mode)
            return mode
    why = "; ".join(f"{mode}: {reason}" for mode, reason in reasons.items())
    raise SandboxError(
        f"no sandbox isolation on this machine ({why}); allow unprivileged user namespaces or install "
        'bubblewrap, or set isolation = "unsafe-local" to run code without isolation'
    )
