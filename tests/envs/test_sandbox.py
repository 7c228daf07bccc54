"""The sandbox for real: hostile programs are stopped quickly and the test process is unharmed.

Each escape is tried twice where it matters: with every layer, and with the kernel layers alone
(`audit_hook=False`, only where this machine allows namespaces) so each layer is shown to hold.
"""

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from tandem.envs.sandbox import Limits, Sandbox, SandboxError, isolation_status

ISOLATED, WHY_NOT = isolation_status()
needs_isolation = pytest.mark.skipif(not ISOLATED, reason=f"no namespace isolation here: {WHY_NOT}")
FAST = Limits(wall_seconds=3.0, cpu_seconds=2, memory_mb=512)


def run(source: str, sandbox: Sandbox | None = None, **files: str):
    return asyncio.run((sandbox or Sandbox(FAST)).run(source, files))


def kernel_only() -> Sandbox:
    return Sandbox(FAST, isolation="require", audit_hook=False)


def test_a_correct_program_runs_with_its_files_and_the_directory_is_removed() -> None:
    source = (
        "import os, json, collections\n"
        "from helper import double\n"
        "open('out.txt', 'w').write('kept')\n"
        "print(double(21), open('out.txt').read(), os.getcwd())\n"
    )
    result = run(source, **{"helper.py": "def double(x):\n    return 2 * x\n"})
    assert result.ok and result.exit_code == 0 and not result.timed_out, result.stderr
    answer, kept, cwd = result.stdout.split()
    assert (answer, kept) == ("42", "kept")
    assert not Path(cwd).exists()
    assert result.isolated == ISOLATED and result.seconds < 2.0


def test_a_failing_program_reports_its_exit_code_and_stderr() -> None:
    result = run("import sys\nprint('partial')\nraise ValueError('boom')")
    assert result.exit_code == 1 and not result.ok and result.stdout == "partial\n"
    assert "ValueError: boom" in result.stderr
    assert run("raise SystemExit(3)").exit_code == 3


def test_an_infinite_loop_is_killed_at_the_wall_clock_limit() -> None:
    start = time.perf_counter()
    result = run("print('started', flush=True)\nwhile True:\n    pass", Sandbox(Limits(wall_seconds=1.0)))
    assert result.timed_out and result.exit_code is None and not result.ok
    assert result.stdout == "started\n"  # output before the kill is kept
    assert time.perf_counter() - start < 4.0


def test_cpu_time_is_limited_even_within_the_wall_clock() -> None:
    result = run("while True:\n    pass", Sandbox(Limits(wall_seconds=20.0, cpu_seconds=1)))
    assert not result.timed_out and result.exit_code in (128 + 9, 128 + 24)  # SIGKILL / SIGXCPU
    assert result.seconds < 15.0  # CPU seconds, not wall seconds: the machine may be busy


def test_a_10_gb_allocation_fails_and_the_machine_is_fine() -> None:
    result = run("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.exit_code == 1 and "MemoryError" in result.stderr and "allocated" not in result.stdout
    result = run("x = [0] * (10 * 1024**3 // 8)")
    assert result.exit_code == 1 and "MemoryError" in result.stderr


FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"


def test_fork_and_subprocess_are_refused() -> None:
    for source in [
        FORK_BOMB,
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()",
        "import ctypes\nctypes.CDLL(None).fork()",
    ]:
        result = run(source)
        assert result.exit_code == 1 and "PermissionError: sandbox:" in result.stderr, (source, result.stderr)


@pytest.mark.parametrize("isolation", ["require", "off"])
def test_without_the_hook_the_kernel_refuses_new_processes_and_sockets(isolation: str) -> None:
    """The seccomp filter alone (with or without namespaces): no fork, no subprocess, no IPv4/IPv6
    socket; threads still work."""
    if isolation == "require" and not ISOLATED:
        pytest.skip(f"no namespace isolation here: {WHY_NOT}")
    sandbox = Sandbox(FAST, isolation=isolation, audit_hook=False)  # type: ignore[arg-type]
    start = time.perf_counter()
    for source in [
        FORK_BOMB,
        "import subprocess\nsubprocess.run(['/bin/true'])",
        "import socket\nsocket.socket(socket.AF_INET)",
        "import socket\nsocket.socket(socket.AF_INET6)",
    ]:
        result = run(source, sandbox)
        assert result.exit_code == 1 and "Operation not permitted" in result.stderr, (source, result.stderr)
    threads = "import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()"
    assert run(threads, sandbox).stdout == "thread\n"
    assert time.perf_counter() - start < 20.0


@pytest.mark.parametrize("layers", ["all", "kernel"])
def test_writes_outside_the_directory_are_refused(layers: str, tmp_path: Path) -> None:
    if layers == "kernel" and not ISOLATED:
        pytest.skip(f"no namespace isolation here: {WHY_NOT}")
    sandbox = Sandbox(FAST) if layers == "all" else kernel_only()
    outside = [Path("/tmp") / f"tandem-escape-{uuid.uuid4().hex}", tmp_path / "escape.txt"]
    for target in outside:
        for source in [
            f"open({str(target)!r}, 'w').write('x')",
            f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
            f"import os\nos.mkdir({str(target)!r})",
        ]:
            result = run(source, sandbox)
            assert result.exit_code == 1, (source, result.stderr)
            assert not target.exists()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    assert run(f"import os\nos.remove({str(victim)!r})", sandbox).exit_code == 1
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("layers", ["all", "kernel"])
def test_the_network_is_unreachable(layers: str) -> None:
    if layers == "kernel" and not ISOLATED:
        pytest.skip(f"no namespace isolation here: {WHY_NOT}")
    sandbox = Sandbox(FAST) if layers == "all" else kernel_only()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        listener.settimeout(0.5)
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')"
        result = run(source, sandbox)
        assert result.exit_code == 1, result.stderr
        with pytest.raises(TimeoutError):
            listener.accept()


def test_secrets_in_the_environment_and_other_processes_stay_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv("TANDEM_TEST_SECRET", secret)
    source = (
        "import os\n"
        "print(dict(os.environ))\n"
        f"for path in ['/proc/{os.getpid()}/environ', '/proc/1/environ', '/proc/self/environ']:\n"
        "    try:\n"
        "        print(open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(path, e)\n"
    )
    result = run(source)
    assert result.exit_code == 0, result.stderr
    assert secret not in result.stdout and "TANDEM_TEST_SECRET" not in result.stdout
    assert "/usr/bin:/bin" in result.stdout


def test_signals_to_the_test_process_are_refused() -> None:
    result = run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)")
    assert result.exit_code == 1 and "PermissionError: sandbox: os.kill" in result.stderr


@needs_isolation
def test_without_the_hook_other_processes_are_invisible() -> None:
    source = f"import os, signal\nprint(os.getpid())\nos.kill({os.getpid()}, signal.SIGKILL)"
    result = run(source, kernel_only())
    assert result.stdout.split()[0] == "1"  # PID 1 of its own namespace
    assert result.exit_code == 1 and "ProcessLookupError" in result.stderr


def test_output_is_capped() -> None:
    result = run("import sys\nsys.stdout.write('x' * 5_000_000)", Sandbox(Limits(output_bytes=1000)))
    assert result.exit_code == 0 and result.output_truncated and result.stdout == "x" * 1000


def test_runs_are_concurrent_up_to_the_limit_and_leave_the_event_loop_free() -> None:
    async def main() -> tuple[float, int]:
        sandbox = Sandbox(FAST, max_concurrent=2)
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
    assert 2.0 <= elapsed < 4.0  # two waves of two
    assert ticks >= 0.5 * elapsed / 0.05


def test_set_up_failures_are_told_apart_from_programs_that_fail() -> None:
    fake = "import sys\nprint('sandbox set-up failed: fake', file=sys.stderr)\nsys.exit(125)"
    result = run(fake)
    assert result.exit_code == 125 and result.error is None  # the program's own doing
    broken = run("print(1)", Sandbox(Limits(open_files=3)))  # no descriptor left for the set-up
    assert broken.error is not None and broken.error.startswith("sandbox set-up failed: OSError")
    assert broken.stdout == ""


def test_bad_file_names_and_required_isolation() -> None:
    with pytest.raises(ValueError, match="plain file name"):
        run("print(1)", **{"../x": "y"})
    if not ISOLATED:
        with pytest.raises(SandboxError, match="isolation is required"):
            Sandbox(isolation="require")
