"""Start a set of processes, stream their output, and stop them all when one fails.

Services (the inference servers) start first and must answer their health URL; then jobs (the
trainer and the orchestrator) start, each once the URLs it waits for (servers on other nodes)
answer. The run succeeds when every job exits 0; services are then stopped. Any process that
exits non-zero, a service that exits at all, a job that exits 0 while another still waits for
what it never made (its `check_done`), a health check that times out, a failure on another node
(`peer_event`), or SIGINT/SIGTERM/SIGHUP to the launcher stops everything: SIGTERM to each
process group, then SIGKILL after the grace period (at once on a second Ctrl-C; the same signal
again within REPEAT_S is the first one delivered twice, as `uv run` does). A failure ends with
one line naming the process, why, and its log. Each child leads its own process group (so
torchrun's workers die with it) and gets SIGTERM from the kernel if the launcher dies (or exits
at once if the launcher died while it was being started); `pass_fds` (the run_dir lock) are
inherited by every child, so that the lock stays held until the last of them has exited, also
after the launcher was killed. A launcher with services but no jobs (a node that only serves)
runs until `peer_event` says the run is done.
"""

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

TAIL_LINES = 20
FAILED_FILE = "FAILED"  # in log_dir: the one-line failure, for what reports a whole job (sbatch)
POLL_S = 0.1
REPEAT_S = 0.5  # a stop signal repeated within this is one signal delivered twice (Supervisor._on_signal)
LOW_DISK_BYTES = 64 << 20  # a failure with less free than this where the logs go says so (a full disk)
COLOURS = ("36", "35", "33", "32", "34", "31")  # cyan, magenta, yellow, green, blue, red

PR_SET_PDEATHSIG = 1


@dataclass
class ProcessSpec:
    """One child: its name (log file and console prefix), command, extra environment, role."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    role: Literal["service", "job"] = "job"
    health_url: str | None = None
    wait_for: list[str] = field(default_factory=list)  # health URLs of services elsewhere (other nodes)
    # a job exiting 0 while other jobs still run: None when its share is done, else why not (the
    # others would wait for what it never made)
    check_done: Callable[[], str | None] | None = None


@dataclass
class Child:
    spec: ProcessSpec
    popen: subprocess.Popen
    pump: threading.Thread
    tail: deque[str]
    started: float

    @property
    def name(self) -> str:
        return self.spec.name


class Console:
    """Prefixed, optionally coloured lines from many threads, one whole line at a time.

    A console that goes away (a closed pipe, `rl ... | head`) is dropped silently: the children's
    output must keep draining into their log files, or they would block on a full pipe.
    """

    def __init__(self, stream: IO[str] | None = None, colour: bool | None = None) -> None:
        out = stream or sys.stdout
        self.colour = out.isatty() and "NO_COLOR" not in os.environ if colour is None else colour
        self.stream: IO[str] | None = out
        self.lock = threading.Lock()

    def line(self, prefix: str, text: str, colour_code: str = "1") -> None:
        head = f"\033[{colour_code}m[{prefix}]\033[0m" if self.colour else f"[{prefix}]"
        with self.lock:
            if self.stream is None:
                return
            try:
                self.stream.write(f"{head} {text}\n")
                self.stream.flush()
            except (OSError, ValueError):
                self.stream = None


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _load_prctl()  # loaded in the parent: a forked child should not dlopen


def _die_with_parent(parent: int) -> None:
    """preexec_fn: have the kernel send SIGTERM to this child when the launcher dies (Linux). A
    launcher that died between the fork and the prctl sends nothing: the child then exits here
    rather than run on without it."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    def __init__(
        self,
        specs: list[ProcessSpec],
        log_dir: Path,
        startup_timeout_s: float = 300.0,
        shutdown_grace_s: float = 10.0,
        console: Console | None = None,
        prog: str = "rl",
        peer_event: Callable[[], tuple[str, str] | None] | None = None,
        pass_fds: tuple[int, ...] = (),
        low_disk_bytes: int = LOW_DISK_BYTES,
    ) -> None:
        self.specs = specs
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.console = console or Console()
        self.prog = prog
        self.peer_event = peer_event  # ("failed" | "done", what) from the other nodes, or None
        self.stopped_by_peer = False
        self.pass_fds = pass_fds  # inherited by every child (the run_dir lock: held while any lives)
        self.low_disk_bytes = low_disk_bytes
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        self.signalled_at = 0.0  # (monotonic) when the first stop signal came
        self.hurry = False  # a second SIGINT/SIGTERM: skip the grace period
        self.stopped_all = False  # _stop_all ran to its end: nothing is left to stop
        self.failure: str | None = None  # what went wrong, one line naming the process (after run())

    # ---- public ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run everything to the end; the launcher's exit code (0 on success)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / FAILED_FILE).unlink(missing_ok=True)
        previous = {s: signal.signal(s, self._on_signal) for s in _stop_signals()}
        start = time.monotonic()
        try:
            code = self._supervise()
        finally:
            self._stop_all()
            self._drain_logs()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if code == 0:
            self.say(f"done in {time.monotonic() - start:.1f} s; logs in {self.log_dir}")
        elif self.failure is not None:
            record_failure(self.log_dir, f"{self.prog}: {self.failure}")
        return code

    def say(self, text: str) -> None:
        self.console.line(self.prog, text)

    # ---- phases ------------------------------------------------------------------------------

    def _supervise(self) -> int:
        services = [s for s in self.specs if s.role == "service"]
        jobs = [s for s in self.specs if s.role == "job"]
        for spec in services:
            self._start(spec)
        for spec in services:
            if spec.health_url and (code := self._wait_healthy(spec)) is not None:
                return code
        for spec in jobs:
            if (code := self._wait_remote(spec)) is not None:
                return code
            self._start(spec)
        return self._watch()

    def _wait_healthy(self, spec: ProcessSpec) -> int | None:
        """None once `spec` is healthy, else the launcher's exit code."""
        assert spec.health_url
        child = next(c for c in self.children if c.spec is spec)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.stop_signal is not None:
                return self._interrupted()
            if (code := self._peer_stop()) is not None:
                return code
            if child.popen.poll() is not None:
                return self._failed(child, "exited before it became healthy")
            if _healthy(spec.health_url, child.popen.pid):
                self.say(f"{spec.name} is healthy ({spec.health_url}) after {self._age(child):.1f} s")
                return None
            time.sleep(0.25)
        return self._failed(
            child, f"did not answer {spec.health_url} within startup_timeout_s={self.startup_timeout_s:g}"
        )

    def _wait_remote(self, spec: ProcessSpec) -> int | None:
        """None once every URL `spec` waits for answers, else the launcher's exit code. The
        processes started so far keep being watched meanwhile."""
        pending = list(spec.wait_for)
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            if self.stop_signal is not None:
                return self._interrupted()
            if (code := self._peer_stop()) is not None:
                return code
            for child in self.children:
                if child.popen.poll() is not None:
                    return self._failed(child, f"exited while {spec.name} waited for servers elsewhere")
            pending = [url for url in pending if not _healthy(url)]
            if pending and time.monotonic() > deadline:
                self._stop_all()
                self.failure = (
                    f"{spec.name} not started: {', '.join(pending)} did not answer within "
                    f"startup_timeout_s={self.startup_timeout_s:g}"
                )
                self.say(self.failure)
                return 1
            if pending:
                time.sleep(0.5)
        if spec.wait_for:
            self.say(f"all {len(spec.wait_for)} server(s) are healthy; starting {spec.name}")
        return None

    def _watch(self) -> int:
        pending_jobs = {c.name for c in self.children if c.spec.role == "job"}
        serve_only = not pending_jobs and self.peer_event is not None
        while True:
            if self.stop_signal is not None:
                return self._interrupted()
            if (code := self._peer_stop(serve_only)) is not None:
                return code
            for child in self.children:
                code = child.popen.poll()
                if code is None or (child.spec.role == "job" and child.name not in pending_jobs):
                    continue
                if code != 0:
                    return self._failed(child, describe_exit(code))
                if child.spec.role == "service":
                    return self._failed(child, "exited while the run was still going (exit code 0)")
                pending_jobs.discard(child.name)
                if pending_jobs and child.spec.check_done and (why := child.spec.check_done()):
                    return self._failed(child, f"exited 0 {why}")
                self.say(f"{child.name} finished after {self._age(child):.1f} s")
            if not pending_jobs and not serve_only:
                return 0
            time.sleep(POLL_S)

    # ---- processes ---------------------------------------------------------------------------

    def _start(self, spec: ProcessSpec) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        log_path = self.log_dir / f"{spec.name}.log"
        popen = subprocess.Popen(
            spec.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            pass_fds=self.pass_fds,
            text=True,
            errors="replace",
            bufsize=1,
        )
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        colour = COLOURS[len(self.children) % len(COLOURS)]
        pump = threading.Thread(
            target=self._pump, args=(spec.name, popen.stdout, log_path, tail, colour), daemon=True
        )
        pump.start()
        self.children.append(Child(spec, popen, pump, tail, time.monotonic()))
        self.say(f"started {spec.name} (pid {popen.pid}), log {log_path}")

    def _pump(self, name: str, stream: IO[str], log_path: Path, tail: deque[str], colour: str) -> None:
        try:
            log: IO[str] | None = log_path.open("a", encoding="utf-8")
        except OSError as e:  # (a full disk: the child must still be drained, or it blocks on the pipe)
            self.console.line(self.prog, f"cannot write {log_path} ({e.strerror}); {name}'s log stays empty")
            log = None
        for raw in stream:  # drain to the end whatever happens, so the child never blocks
            line = raw.rstrip("\n")
            tail.append(line)
            self.console.line(name, line, colour)
            if log is not None:
                try:
                    log.write(line + "\n")
                    log.flush()
                except OSError as e:
                    self.console.line(
                        self.prog, f"cannot write {log_path} ({e.strerror}); {name}'s log stops here"
                    )
                    with contextlib.suppress(OSError):
                        log.close()
                    log = None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()

    def _drain_logs(self) -> None:
        """Wait until every ended child's last output is in its log: a job that exited may still
        have lines in its pipe that its pump has not written yet (the pump ends at the pipe's end;
        a descendant that keeps the pipe open is waited for at most 5 s)."""
        for child in self.children:
            if child.popen.poll() is not None:
                child.pump.join(timeout=5)

    def _stop_all(self) -> None:
        """SIGTERM every process group still alive, SIGKILL what is left after the grace period."""
        live = [c for c in self.children if _group_alive(c.popen.pid)]
        if not live or self.stopped_all:  # (SIGKILLed descendants may linger unreaped a moment)
            return
        self.say(f"stopping {', '.join(c.name for c in live)}")
        for child in live:
            _signal_group(child.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_grace_s
        while time.monotonic() < deadline and not self.hurry and any(_group_alive(c.popen.pid) for c in live):
            for child in live:
                child.popen.poll()  # reap the leader, so its group can empty
            time.sleep(POLL_S)
        for child in live:
            if _group_alive(child.popen.pid):
                reason = (
                    "a second signal" if self.hurry else f"SIGTERM ignored for {self.shutdown_grace_s:g} s"
                )
                self.say(f"{child.name} still running ({reason}); sending SIGKILL")
                _signal_group(child.popen.pid, signal.SIGKILL)
        for child in live:
            try:
                child.popen.wait(timeout=10)  # (run() then waits for their logs: _drain_logs)
            except subprocess.TimeoutExpired:  # stuck in the kernel after SIGKILL (a GPU driver's teardown)
                self.say(f"{child.name} (pid {child.popen.pid}) did not exit 10 s after SIGKILL; leaving it")
        self.stopped_all = True

    # ---- outcomes ----------------------------------------------------------------------------

    def _failed(self, child: Child, reason: str) -> int:
        if child.popen.poll() is not None:
            _signal_group(child.popen.pid, signal.SIGKILL)  # leftovers of a dead leader (torchrun workers)
            child.pump.join(timeout=5)
        self._stop_all()
        reason += _low_disk(self.log_dir, self.low_disk_bytes)
        self.failure = f"{child.name} failed: {reason} (log {self.log_dir / (child.name + '.log')})"
        self.say(f"{child.name} failed: {reason}. Its last {len(child.tail)} lines:")
        for line in child.tail:
            self.console.line(child.name, line)
        self.say(self.failure)  # (last: the one line that says which process and where its log is)
        code = child.popen.returncode
        return code if code and code > 0 else 1

    def _peer_stop(self, serve_only: bool = False) -> int | None:
        """The exit code when another node failed, or (`serve_only`) when the run is done."""
        event = self.peer_event() if self.peer_event else None
        if event is None or (event[0] == "done" and not serve_only):
            return None
        kind, what = event
        self.say(f"stopping: {what}")
        self._stop_all()
        if kind == "done":
            return 0
        self.stopped_by_peer = True
        return 1

    def _interrupted(self) -> int:
        assert self.stop_signal is not None
        self.say(f"received {signal.Signals(self.stop_signal).name}; stopping")
        self._stop_all()
        return 128 + self.stop_signal

    def _on_signal(self, signum: int, _frame: object) -> None:
        """The first stop signal stops the run with a grace period; a second one skips it. The same
        signal again within REPEAT_S is the first one forwarded (`uv run` passes on a signal its
        child's group already had, when stdin is not a terminal), not a second."""
        now = time.monotonic()
        if self.stop_signal is None:
            self.stop_signal, self.signalled_at = signum, now
        elif signum != self.stop_signal or now - self.signalled_at > REPEAT_S:
            self.hurry = True

    def _age(self, child: Child) -> float:
        return time.monotonic() - child.started


def _low_disk(path: Path, below: int) -> str:
    """What a failure's line adds when `path`'s filesystem is (nearly) full: the failed process's
    own error may not say so (torch's checkpoint writer: "unexpected pos 704 vs 598")."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f"; the filesystem of {path} has {free / 2**20:.0f} MiB free" if free < below else ""


def _stop_signals() -> list[int]:
    """The signals that stop the run cleanly: Ctrl-C, SIGTERM, and SIGHUP (the terminal or the ssh
    session closed: by default it killed the launcher at once, leaving the children to the
    kernel's SIGTERM and their logs without their ends), unless ignored (`nohup rl ...`)."""
    hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else []
    return [signal.SIGINT, signal.SIGTERM, *hangup]


def record_failure(log_dir: Path, line: str) -> None:
    """Leave `line` in log_dir/FAILED, where the end of a batch job reads which process failed."""
    with contextlib.suppress(OSError):
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / FAILED_FILE).write_text(line + "\n")


def _healthy(url: str, pid: int | None = None) -> bool:
    """`url` answers 200, and with `pid`, from that process where the body says its pid: another
    launcher's server on the same port (both passed the port check before either bound it) is not
    this launcher's."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            if response.status != 200:
                return False
            body = response.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False
    if pid is None:
        return True
    try:
        answered = json.loads(body).get("pid", pid)
    except (ValueError, AttributeError):
        return True  # (a health URL of another kind: its status is the answer)
    return answered == pid


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """True while any process (zombies included) is in the group."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
