"""The sandbox for real: hostile programs reach nothing of the host, cannot regain what was taken,
are held to their limits, and the test process goes on unharmed.

Every escape is tried in each isolated mode this machine has (`namespaces`; `bubblewrap` where
bwrap is installed — .ci/run installs it). The programs use ctypes and raw system calls freely:
no guard inside the interpreter is assumed.
"""

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import tandem
from tandem.envs.code_env import PROBLEMS_FILE
from tandem.envs.sandbox import Limits, Sandbox, SandboxError, isolation_status
from tandem.envs.sandbox.policy import interpreter_files

AVAILABLE = [mode for mode, why in isolation_status().items() if why is None]
FAST = Limits(wall_seconds=5.0, cpu_seconds=3, memory_mb=512, disk_mb=8)
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no sandbox isolation here: {isolation_status()}")


@pytest.fixture(params=AVAILABLE)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


def run(source: str, mode: str, limits: Limits = FAST, families: tuple[str, ...] = (), **files: str):
    return asyncio.run(Sandbox(limits, isolation=mode, socket_families=families).run(source, files))  # type: ignore[arg-type]


def lines(result) -> dict[str, str]:
    """`name: outcome` lines the hostile programs print, as a dict."""
    assert result.error is None, result.error
    return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


TRY = """
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, action):
    try:
        value = action()
    except BaseException as e:
        print(f"{name}: refused {type(e).__name__}", flush=True)
    else:
        print(f"{name}: DONE {value!r}"[:300], flush=True)
def call(result):
    if result == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result
"""


def test_a_correct_program_runs_with_its_files_in_a_fresh_job_directory(mode: str) -> None:
    source = (
        "import os, json, collections, threading\n"
        "from helper import double\n"
        "open('out.txt', 'w').write('kept')\n"
        "print(double(21), open('out.txt').read(), os.getcwd(), os.getuid(), os.environ['HOME'])\n"
    )
    result = run(source, mode, **{"helper.py": "def double(x):\n    return 2 * x\n"})
    assert result.ok and result.error is None and result.isolation == mode, result.stderr
    assert result.stdout.split() == ["42", "kept", "/job", "1000", "/job"]


def test_a_failing_program_reports_its_exit_code_and_stderr(mode: str) -> None:
    result = run("import sys\nprint('partial')\nraise ValueError('boom')", mode)
    assert result.exit_code == 1 and not result.ok and result.stdout == "partial\n"
    assert "ValueError: boom" in result.stderr and result.error is None
    fake = run("import sys\nprint('sandbox set-up failed: fake', file=sys.stderr)\nsys.exit(125)", mode)
    assert fake.exit_code == 125 and fake.error is None  # the program's own doing, not the sandbox's


def test_the_host_filesystem_is_not_there(mode: str, tmp_path: Path) -> None:
    """No /etc, no home, no project, no run directory, no answer key: only the interpreter."""
    secret = tmp_path / "checkpoint.bin"
    secret.write_text("weights")
    targets = {
        "passwd": "/etc/passwd",
        "shadow": "/etc/shadow",
        "home": str(Path.home()),
        "project": str(Path(tandem.__file__).parent),
        "answers": str(PROBLEMS_FILE),
        "run_dir": str(secret),
        "cwd": os.getcwd(),
        "site": str(Path(json.__file__).parent.parent / "site-packages"),
    }
    source = TRY + "".join(
        f"attempt({name!r}, lambda: os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read())\n"
        for name, path in targets.items()
    )
    source += "print('root: ' + ' '.join(sorted(os.listdir('/'))))\n"
    outcome = lines(run(source, mode))
    for name, path in targets.items():  # a directory on the way to the interpreter shows only that way
        on_the_way = sorted({m[len(path) + 1 :].split("/")[0] for m in mounts() if m.startswith(path + "/")})
        assert outcome[name].startswith("refused") or outcome[name] == f"DONE {on_the_way!r}", (
            name,
            outcome[name],
        )
    assert set(outcome["root"].split()) <= {"dev", "job", "proc", *(m.split("/")[1] for m in mounts())}


def mounts() -> list[str]:
    files = interpreter_files()
    return [*files.mounts, *(link for link, _ in files.symlinks)]


def test_nothing_taken_can_be_regained(mode: str) -> None:
    """Capabilities, no_new_privs, locked mounts, namespaces and ptrace: all refused by the kernel."""
    source = TRY + (
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "print('caps: ' + ' '.join(status[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')))\n"
        "print('nnp: ' + status['NoNewPrivs'].strip() + ' ' + status['Seccomp'].strip())\n"
        "attempt('remount root rw', lambda: call(libc.mount(None, b'/', None, 0x20 | 0x1000, None)))\n"
        "attempt('remount libs rw', lambda: call(libc.mount(None, b'/usr/lib', None, 0x20 | 0x1000, None)))\n"
        "attempt('mount tmpfs', lambda: call(libc.mount(b'x', b'/job', b'tmpfs', 0, None)))\n"
        "attempt('unmount proc', lambda: call(libc.umount2(b'/proc', 2)))\n"
        "attempt('new user namespace', lambda: call(libc.unshare(0x10000000)))\n"
        "attempt('new mount namespace', lambda: call(libc.unshare(0x20000)))\n"
        "attempt('setns', lambda: call(libc.setns(os.open('/proc/self/ns/mnt', os.O_RDONLY), 0)))\n"
        "attempt('chroot', lambda: call(libc.chroot(b'/job')))\n"
        "attempt('ptrace', lambda: call(libc.ptrace(16, 1, 0, 0)))\n"
        "attempt('process_vm_readv', lambda: call(libc.process_vm_readv(1, 0, 0, 0, 0, 0)))\n"
        "attempt('io_uring', lambda: call(libc.syscall(425, 1, 0)))\n"
        "attempt('bpf', lambda: call(libc.syscall(321, 0, 0, 0)))\n"
        "attempt('fork', os.fork)\n"
    )
    if os.uname().machine == "x86_64":  # the same calls through the x32 ABI
        source += (
            "attempt('x32 mount', lambda: call(libc.syscall(0x40000000 + 165, 0, b'/', 0, 0x21020, 0)))\n"
        )
    outcome = lines(run(source, mode))
    assert outcome.pop("caps") == " ".join(["0000000000000000"] * 5)
    assert outcome.pop("nnp") == "1 2"  # no_new_privs, seccomp filter mode
    assert all(v.startswith("refused") for v in outcome.values()), outcome


def test_writes_outside_the_job_directory_fail_and_leave_the_host_untouched(
    mode: str, tmp_path: Path
) -> None:
    host_target = tmp_path / "escape.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    source = TRY + (
        f"attempt('host path', lambda: open({str(host_target)!r}, 'w').write('x'))\n"
        f"attempt('remove host file', lambda: os.remove({str(victim)!r}))\n"
        "for path in ['/x', '/usr/lib/x', '/dev/x', '/etc/x', '/proc/sys/kernel/hostname', '/proc/sysrq-trigger']:\n"
        "    attempt(path, lambda: open(path, 'w').write('1'))\n"
        "root = os.open('/', os.O_RDONLY)\n"
        "attempt('directory fd', lambda: os.open('y', os.O_CREAT | os.O_WRONLY, dir_fd=root))\n"
        "attempt('proc root', lambda: open('/proc/self/root/z', 'w'))\n"
        "attempt('mkfifo', lambda: os.mkfifo('/fifo'))\n"
        "attempt('mknod', lambda: os.mknod('/job/null', 0o20600, os.makedev(1, 3)))\n"
        "attempt('symlink out', lambda: os.symlink('/', '/job/up') or open('/job/up/w', 'w'))\n"
        "attempt('job', lambda: open('/job/inside.txt', 'w').write('ok'))\n"
    )
    outcome = lines(run(source, mode))
    assert outcome.pop("job") == "DONE 2"
    assert all(v.startswith("refused") for v in outcome.values()), outcome
    assert not host_target.exists() and victim.read_text() == "precious"


def test_total_disk_is_limited(mode: str) -> None:
    source = (
        "n = 0\ntry:\n    while True:\n"
        "        open(f'f{n}', 'wb').write(b'x' * (1 << 20))\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)\n"
    )
    result = run(source, mode, Limits(disk_mb=8))
    written, errno = result.stdout.split()
    assert int(written) <= 8 and errno == "28"  # ENOSPC: 8 MB in all
    big = run("print(1)", mode, Limits(disk_mb=1), **{"data.txt": "x" * (2 << 20)})
    assert big.error is not None and big.stdout == ""  # files that do not fit: a set-up failure


def test_sockets_of_every_family_are_refused_and_outside_listeners_see_nothing(
    mode: str, tmp_path: Path
) -> None:
    path = tmp_path / "listener.sock"
    abstract = f"\0tandem-test-{uuid.uuid4().hex}"
    with (
        socket.socket(socket.AF_UNIX) as unix,
        socket.socket(socket.AF_UNIX) as hidden,
        socket.create_server(("127.0.0.1", 0)) as tcp,
    ):
        unix.bind(str(path))
        hidden.bind(abstract)
        for listener in (unix, hidden, tcp):
            listener.listen()
            listener.settimeout(0.2)
        source = TRY + (
            f"attempt('unix path', lambda: socket.socket(socket.AF_UNIX).connect({str(path)!r}))\n"
            f"attempt('unix abstract', lambda: socket.socket(socket.AF_UNIX).connect({abstract!r}))\n"
            f"attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), 1))\n"
            "attempt('ipv6', lambda: socket.socket(socket.AF_INET6))\n"
            "attempt('netlink', lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))\n"
            "attempt('packet', lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))\n"
            "attempt('socketpair', socket.socketpair)\n"
        )
        outcome = lines(run(source, mode))
        assert all(v.startswith("refused") for v in outcome.values()), outcome
        allowed = lines(run(source, mode, families=("AF_UNIX", "AF_INET")))
        for listener in (unix, hidden, tcp):
            with pytest.raises(TimeoutError):
                listener.accept()
    assert allowed["socketpair"].startswith("DONE") and allowed["ipv6"].startswith("refused")
    assert all(allowed[k].startswith("refused") for k in ("unix path", "unix abstract", "tcp"))


def test_allowed_ip_sockets_reach_only_the_sandbox_itself(mode: str) -> None:
    source = (
        "import socket\nserver = socket.create_server(('127.0.0.1', 0))\n"
        "client = socket.create_connection(server.getsockname(), timeout=2)\n"
        "client.sendall(b'ping')\nprint(server.accept()[0].recv(4).decode())\n"
    )
    result = run(source, mode, families=("AF_INET",))
    assert result.stdout == "ping\n", result.stderr


def test_other_processes_are_invisible_and_cannot_be_signalled(mode: str) -> None:
    me = os.getpid()
    os.environ["TANDEM_TEST_SECRET"] = secret = uuid.uuid4().hex
    try:
        source = TRY + (
            "print('pids: ' + ' '.join(sorted(p for p in os.listdir('/proc') if p.isdigit())))\n"
            f"attempt('kill test process', lambda: os.kill({me}, 9))\n"
            f"attempt('pidfd', lambda: call(libc.syscall(434, {me}, 0)))\n"
            f"attempt('parent environ', lambda: open('/proc/{me}/environ').read())\n"
            "attempt('kill parent', lambda: os.kill(os.getppid() or 1, 9))\n"
            "attempt('kill everything', lambda: os.kill(-1, 9))\n"
            "print('env: ' + repr(dict(os.environ)) + repr(open('/proc/1/environ', 'rb').read()))\n"
        )
        outcome = lines(run(source, mode))
    finally:
        del os.environ["TANDEM_TEST_SECRET"]
    # the program alone, as PID 1: no process of the set-up (bwrap's init had no seccomp filter and
    # its /proc/1/mem was writable by the program) is left inside
    assert outcome.pop("pids").split() == ["1"]
    env = outcome.pop("env")
    assert secret not in env and "TANDEM_TEST_SECRET" not in env and "/usr/bin:/bin" in env
    for name in ("kill test process", "pidfd", "parent environ"):
        assert outcome[name].startswith("refused"), (name, outcome[name])
    # whatever "kill parent" and "kill -1" did, it stayed inside: this process is here to check


def test_limits_hold_against_programs_that_ignore_signals_and_start_sessions(mode: str) -> None:
    marker = uuid.uuid4().hex
    ignore = "import os, signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n    signal.signal(s, signal.SIG_IGN)\n"
    start = time.perf_counter()
    wall = run(
        ignore + "os.setsid()\nprint('looping', flush=True)\nwhile True:\n    pass\n",
        mode,
        Limits(wall_seconds=1.0, cpu_seconds=30),
    )
    assert wall.timed_out and wall.exit_code is None and wall.stdout == "looping\n"
    assert time.perf_counter() - start < 5.0
    cpu = run(ignore + "while True:\n    pass\n", mode, Limits(wall_seconds=30.0, cpu_seconds=1))
    assert not cpu.timed_out and cpu.exit_code == 128 + 9 and cpu.seconds < 20.0  # SIGKILL at the hard limit
    memory = run("x = bytearray(10 * 1024**3)\nprint('allocated')", mode)
    assert memory.exit_code == 1 and "MemoryError" in memory.stderr and memory.stdout == ""
    if mode == "bubblewrap" and os.geteuid() == 0:
        return  # processes cannot be counted for root's bwrap: max_processes > 1 is refused (below)
    children = (
        ignore + "import sys\nfor i in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {marker!r}])\n"
        "print('started', flush=True)\ntime.sleep(60)\n"
    )
    escaped = run(children, mode, Limits(wall_seconds=1.5, max_processes=4))
    assert escaped.timed_out and escaped.stdout == "started\n", escaped.stderr
    time.sleep(0.3)
    survivors = [p for p in Path("/proc").glob("[0-9]*") if marker in read_cmdline(p)]
    assert survivors == []
    bomb = "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            os.pause()\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)\n"
    capped = run(bomb, mode, Limits(max_processes=8, max_tasks=8))
    assert capped.stdout.split() == ["7", "11"], capped.stderr  # EAGAIN with 8 tasks


UNTIE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
high = ctypes.c_long((1 << 32) | 1)  # prctl's option is an int: the kernel drops the high bits
print('untied:', libc.prctl(1, 0, 0, 0, 0), libc.syscall(157, high, 0, 0, 0, 0), flush=True)
os.setsid()  # out of the runner's process group too
os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]])
"""
"""Clears its parent-death signal (PR_SET_PDEATHSIG 0, also with high bits set), starts a session
and sleeps with `argv[1]` (a marker) on its command line."""


def marked(marker: str) -> list[Path]:
    return [p for p in Path("/proc").glob("[0-9]*") if marker in read_cmdline(p)]


def test_a_program_cannot_untie_itself_from_the_runner(mode: str) -> None:
    """Were PID 1 to clear its PDEATHSIG and leave the runner's process group, nothing would kill
    it at the wall-clock limit: it would outlive the run (and hold the output pipes open)."""
    marker = uuid.uuid4().hex
    source = f"import sys\nsys.argv[1:] = [{marker!r}]\n" + UNTIE
    result = run(source, mode, Limits(wall_seconds=1.5))
    assert result.timed_out and result.error is None
    assert result.stdout == "untied: -1 -1\n", result.stdout  # both refused
    time.sleep(0.3)
    assert marked(marker) == []


CALLER = """
import asyncio, os, sys
from tandem.envs.sandbox import Limits, Sandbox
source = "import os, sys\\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', %r])"
sandbox = Sandbox(Limits(wall_seconds=60), isolation=sys.argv[1])
asyncio.run(sandbox.run(source % os.environ["MARKER"]))
"""


def test_the_program_dies_with_its_caller(mode: str) -> None:
    """A caller killed mid-run (SIGKILL, the OOM killer) takes its sandboxed programs with it."""
    marker = uuid.uuid4().hex  # in the environment of the caller, on the command line of the program
    env = {**os.environ, "MARKER": marker}
    caller = subprocess.Popen([sys.executable, "-c", CALLER, mode], env=env)
    try:
        deadline = time.monotonic() + 20
        while not marked(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marked(marker), "the program did not start"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 3
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(marker) == []


@pytest.mark.parametrize("isolation", [*AVAILABLE, "unsafe-local"])
def test_a_cancelled_run_leaves_no_process_descriptor_or_directory_behind(isolation: str) -> None:
    """A rollout timeout cancels the runs in flight: their programs die and the pipes and job
    directories they had are released (each cancelled run kept its status pipe open, until a long
    run's timeouts had used up the process's descriptors and every later rollout failed)."""
    marker = uuid.uuid4().hex
    sleeper = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])"
    scratch = set(Path(tempfile.gettempdir()).glob("tandem-sandbox-*"))

    async def main() -> int:
        sandbox = Sandbox(Limits(wall_seconds=60), isolation=isolation)  # type: ignore[arg-type]
        assert (await sandbox.run("pass")).ok  # what the first run opens for good is no leak
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sandbox.run(sleeper), 1.0)
        await asyncio.sleep(0.3)
        return len(os.listdir("/proc/self/fd")) - before

    assert asyncio.run(main()) == 0
    deadline = time.monotonic() + 3
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(marker) == []
    assert set(Path(tempfile.gettempdir()).glob("tandem-sandbox-*")) <= scratch


def test_memory_no_process_maps_is_refused(mode: str) -> None:
    """Detached System V segments, message queues and memfds hold memory RLIMIT_AS never counts."""
    source = TRY + (
        "attempt('shmget', lambda: call(libc.shmget(0, 1 << 20, 0o1600)))\n"
        "attempt('msgget', lambda: call(libc.msgget(0, 0o1600)))\n"
        "attempt('semget', lambda: call(libc.semget(0, 1, 0o1600)))\n"
        "attempt('memfd', lambda: os.memfd_create('x'))\n"
    )
    outcome = lines(run(source, mode, Limits(memory_mb=128)))
    assert len(outcome) == 4 and all(v.startswith("refused") for v in outcome.values()), outcome


def read_cmdline(process: Path) -> str:
    try:
        return (process / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_processes_are_refused_unless_allowed_and_threads_work(mode: str) -> None:
    source = TRY + (
        "import subprocess, threading\n"
        "attempt('fork', os.fork)\n"
        "attempt('subprocess', lambda: subprocess.run(['/bin/true']))\n"
        "attempt('clone', lambda: call(libc.syscall(56, 17, 0, 0, 0, 0)))\n"  # SIGCHLD: a process
        "t = threading.Thread(target=print, args=('thread: ran',))\nt.start()\nt.join()\n"
    )
    outcome = lines(run(source, mode))
    assert outcome.pop("thread") == "ran"
    assert all(v.startswith("refused") for v in outcome.values()), outcome


def test_output_is_capped(mode: str) -> None:
    result = run("import sys\nsys.stdout.write('x' * 5_000_000)", mode, Limits(output_bytes=1000))
    assert result.exit_code == 0 and result.output_truncated and result.stdout == "x" * 1000


def test_runs_are_concurrent_up_to_the_limit_and_leave_the_event_loop_free(mode: str) -> None:
    async def main() -> tuple[float, int]:
        sandbox = Sandbox(FAST, max_concurrent=2, isolation=mode)  # type: ignore[arg-type]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        results = await asyncio.gather(*(sandbox.run("import time\ntime.sleep(1)") for _ in range(4)))
        elapsed = time.perf_counter() - start
        tick.cancel()
        assert all(r.ok for r in results)
        return elapsed, ticks

    elapsed, ticks = asyncio.run(main())
    assert 2.0 <= elapsed < 5.0  # two waves of two
    assert ticks >= 0.5 * elapsed / 0.05


def test_bad_file_names_and_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="plain file name"):
        run("print(1)", AVAILABLE[0], **{"../x": "y"})
    with pytest.raises(ValueError, match="unknown socket families"):
        Sandbox(socket_families=("AF_PACKET",))
    with pytest.raises(ValueError, match="sandbox limits must be positive: disk_mb"):
        Limits(disk_mb=0)
    with pytest.raises(SandboxError, match="max_processes = 2 needs a sandbox that can count processes"):
        Sandbox(Limits(max_processes=2), isolation="unsafe-local")


def test_unsafe_local_says_so_and_still_filters_system_calls(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        sandbox = Sandbox(FAST, isolation="unsafe-local")
    result = asyncio.run(sandbox.run("import os, socket\nprint(os.getcwd())\nsocket.socket()"))
    assert result.isolation == "unsafe-local" and result.exit_code == 1
    assert "Operation not permitted" in result.stderr and not Path(result.stdout.strip()).exists()


CONTAINER_PROFILE = """
import errno, sys
import pyseccomp as s
# What common container runtimes' default seccomp profiles do: no new user namespaces.
f = s.SyscallFilter(s.ALLOW)
f.add_rule(s.ERRNO(errno.EPERM), "unshare")
f.add_rule(s.ERRNO(errno.EPERM), "clone", s.Arg(0, s.MASKED_EQ, 0x10000000, 0x10000000))
f.add_rule(s.ERRNO(errno.ENOSYS), "clone3")
f.load()
from tandem.envs.sandbox import Sandbox, SandboxError
try:
    Sandbox(isolation=sys.argv[1])
except SandboxError as e:
    print("refused:", e)
else:
    print("ran")
"""


@pytest.mark.parametrize("with_bwrap", [False, True])
def test_auto_refuses_rather_than_falling_back_where_namespaces_are_blocked(with_bwrap: bool) -> None:
    """Without user namespaces (and without a bwrap that works there) `auto` refuses to run code;
    only `unsafe-local`, asked for by name, runs it."""
    if with_bwrap and shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed")
    path = os.path.dirname(shutil.which("bwrap") or "/usr/bin") if with_bwrap else "/nonexistent"

    def attempt(isolation: str) -> str:
        env = {"PATH": path, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(
            [sys.executable, "-c", CONTAINER_PROFILE, isolation],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    refused = attempt("auto")
    assert refused.startswith("refused: no sandbox isolation on this machine (namespaces: ")
    assert "unsafe-local" in refused and len(refused.splitlines()) == 1
    assert ("bubblewrap: bwrap is not installed" in refused) != with_bwrap
    assert attempt("unsafe-local") == "ran"


NOBODY_RUN = """
import asyncio, sys
sys.path[:0] = sys.argv[1:]
from tandem.envs.sandbox import Limits, Sandbox
result = asyncio.run(Sandbox(Limits(max_processes=4, max_tasks=4), isolation="namespaces").run(
    "import os\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n            os.pause()\\n"
    "        n += 1\\nexcept OSError:\\n    print(os.getuid(), n, sorted(os.listdir('/')))\\n"))
print(result.error, result.stdout.strip())
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_it_needs_no_privileges() -> None:
    """The same sandbox started by an unprivileged user (nobody), with the system's python3."""
    python = shutil.which("python3", path="/usr/bin")
    if (
        python is None
        or subprocess.run([python, "-c", "import sys; assert sys.version_info >= (3, 11)"]).returncode
    ):
        pytest.skip("no system python3 >= 3.11 for the unprivileged user")
    import pyseccomp

    paths = [str(Path(tandem.__file__).parents[1]), str(Path(pyseccomp.__file__).parent)]
    for p in paths:  # nobody must be able to read them
        if not all(os.stat(d).st_mode & 0o005 == 0o005 for d in [p, *map(str, Path(p).parents)]):
            pytest.skip(f"{p} is not readable by other users")
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c", NOBODY_RUN, *paths],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("None 1000 3 "), (done.stdout, done.stderr)
