"""The supervisor with real child processes: start order, health, failure, shutdown, signals."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import alive, child, wait_for

from tandem.launch.supervisor import REPEAT_S, Console, ProcessSpec, Supervisor
from tandem.net import free_port

RUNNER = str(Path(__file__).with_name("supervise_json.py"))


def supervise(specs: list[ProcessSpec], tmp_path: Path, **kwargs: float) -> tuple[int, str, Supervisor]:
    out = io.StringIO()
    sup = Supervisor(specs, tmp_path / "logs", console=Console(out, colour=False), **kwargs)
    code = sup.run()
    return code, out.getvalue(), sup


def service(port: int) -> ProcessSpec:
    return ProcessSpec(
        "inference", child("service", port), role="service", health_url=f"http://127.0.0.1:{port}/health"
    )


def test_jobs_finish_then_services_stop(tmp_path: Path) -> None:
    port = free_port()
    specs = [service(port), ProcessSpec("trainer", child("job", "trainer", 3, 0, 0.5))]
    specs.append(ProcessSpec("orchestrator", child("job", "orch", 2, 0, 0.2)))
    code, out, sup = supervise(specs, tmp_path)

    assert code == 0
    assert not any(alive(c.popen.pid) for c in sup.children)
    assert "[trainer] trainer line 2" in out and "[orchestrator] orch line 1" in out
    assert "[rl] inference is healthy" in out
    # the jobs started only after the service answered its health check
    assert out.index("inference is healthy") < out.index("started trainer")
    log = (tmp_path / "logs" / "trainer.log").read_text().splitlines()
    assert log == ["trainer line 0", "trainer line 1", "trainer line 2"]
    assert "service listening" in (tmp_path / "logs" / "inference.log").read_text()


def test_a_server_of_another_launcher_on_the_port_is_not_taken_for_its_own(tmp_path: Path) -> None:
    """Two launchers started together both pass the port check; the second took the first's server
    for its own (its trainer and orchestrator started against it) while its own server failed to bind."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps({"status": "ok", "pid": 1}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Other)
    port = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        specs = [service(port), ProcessSpec("trainer", child("job", "trainer", 1, 0, 0))]
        code, out, _ = supervise(specs, tmp_path)
    finally:
        other.shutdown()
    assert code != 0 and "inference failed: exited before it became healthy" in out, out
    assert "started trainer" not in out and "is healthy" not in out


@pytest.mark.timeout(60)  # a pump that stopped draining would block the child forever
def test_output_keeps_draining_when_the_console_is_gone(tmp_path: Path) -> None:
    closed = io.StringIO()
    closed.close()  # like stdout piped into `head` that has exited
    specs = [ProcessSpec("trainer", child("job", "trainer", 20_000, 0, 0))]  # far more than a pipe buffers
    sup = Supervisor(specs, tmp_path / "logs", console=Console(closed, colour=False))

    assert sup.run() == 0
    lines = (tmp_path / "logs" / "trainer.log").read_text().splitlines()
    assert len(lines) == 20_000 and lines[-1] == "trainer line 19999"


def test_failure_stops_the_rest_and_reports_tail(tmp_path: Path) -> None:
    port = free_port()
    specs = [
        service(port),
        ProcessSpec("trainer", child("job", "trainer", 30, 3, 0.3)),
        ProcessSpec("orchestrator", child("job", "orch", 1, 0, 120)),
    ]
    start = time.monotonic()
    code, out, sup = supervise(specs, tmp_path, shutdown_grace_s=5)
    elapsed = time.monotonic() - start

    assert code == 3
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert not any(alive(c.popen.pid) for c in sup.children)
    report = out[out.index("trainer failed: exit code 3") :]
    assert "Its last 20 lines" in report
    assert "[trainer] trainer line 29" in report and "[trainer] trainer line 10" in report
    assert "trainer line 9\n" not in report
    # the last line: which process, why, and where its whole log is (it was "full log: PATH")
    assert (
        out.splitlines()[-1] == f"[rl] trainer failed: exit code 3 (log {tmp_path / 'logs' / 'trainer.log'})"
    )


def test_sigterm_ignored_leads_to_sigkill(tmp_path: Path) -> None:
    pidfile = tmp_path / "stubborn.pid"
    specs = [
        ProcessSpec("stubborn", child("stubborn", pidfile)),
        ProcessSpec("trainer", child("job", "trainer", 1, 1, 1.0)),
    ]
    start = time.monotonic()
    code, out, _ = supervise(specs, tmp_path, shutdown_grace_s=1)

    assert code == 1
    assert time.monotonic() - start < 10
    assert "stubborn still running (SIGTERM ignored for 1 s); sending SIGKILL" in out
    assert not alive(int(pidfile.read_text()))


def test_whole_process_group_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "spawner.pid"
    specs = [
        ProcessSpec("spawner", child("spawner", pidfile)),
        ProcessSpec("trainer", child("job", "trainer", 1, 2, 1.5)),
    ]
    code, _, _ = supervise(specs, tmp_path, shutdown_grace_s=3)

    assert code == 2
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    wait_for(lambda: not any(alive(p) for p in pids), 5, "the spawner and its grandchild to be gone")


def test_health_timeout_is_a_failure(tmp_path: Path) -> None:
    port = free_port()  # nothing will listen here
    specs = [
        ProcessSpec(
            "inference",
            child("job", "silent", 1, 0, 60),
            role="service",
            health_url=f"http://127.0.0.1:{port}/health",
        ),
        ProcessSpec("trainer", child("job", "trainer", 1, 0, 0)),
    ]
    code, out, sup = supervise(specs, tmp_path, startup_timeout_s=1.5, shutdown_grace_s=2)

    assert code == 1
    assert "inference failed: did not answer" in out and "startup_timeout_s=1.5" in out
    assert [c.name for c in sup.children] == ["inference"], "jobs must not start before services are healthy"
    assert not alive(sup.children[0].popen.pid)


def test_service_exiting_early_is_a_failure(tmp_path: Path) -> None:
    specs = [
        ProcessSpec(
            "inference", child("job", "crash", 2, 7, 0), role="service", health_url="http://127.0.0.1:9/h"
        ),
        ProcessSpec("trainer", child("job", "trainer", 1, 0, 0)),
    ]
    code, out, _ = supervise(specs, tmp_path)

    assert code == 7
    assert "inference failed: exited before it became healthy" in out
    assert "[inference] crash line 1" in out


def start_launcher(
    tmp_path: Path, specs: list[dict], grace_s: float, run_dir: Path | None = None, **popen: object
) -> tuple[subprocess.Popen, dict[str, int]]:
    """Run the supervisor in its own process (holding run_dir's lock, passed to its children, as
    `rl` does); return it once every child has started, with their pids."""
    spec_file = tmp_path / "specs.json"
    spec_file.write_text(json.dumps(specs))
    locked = [] if run_dir is None else [str(run_dir)]
    launcher = subprocess.Popen(
        [sys.executable, RUNNER, str(spec_file), str(tmp_path / "logs"), str(grace_s), *locked],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,  # type: ignore[call-overload]
    )
    pids: dict[str, int] = {}
    assert launcher.stdout is not None
    for line in launcher.stdout:
        if m := re.search(r"started (\w+) \(pid (\d+)\)", line):
            pids[m[1]] = int(m[2])
        if len(pids) == len(specs):
            break
    assert set(pids) == {s["name"] for s in specs}
    assert all(alive(p) for p in pids.values())
    return launcher, pids


def test_sigint_to_launcher_stops_all_children(tmp_path: Path) -> None:
    port = free_port()
    specs = [
        {"name": "inference", "argv": child("service", port), "role": "service",
         "health_url": f"http://127.0.0.1:{port}/health"},
        {"name": "trainer", "argv": child("job", "trainer", 1, 0, 120)},
        {"name": "orchestrator", "argv": child("job", "orch", 1, 0, 120)},
    ]  # fmt: skip
    launcher, pids = start_launcher(tmp_path, specs, grace_s=5)

    launcher.send_signal(signal.SIGINT)
    rest, _ = launcher.communicate(timeout=20)

    assert launcher.returncode == 130
    assert "received SIGINT; stopping" in rest
    wait_for(lambda: not any(alive(p) for p in pids.values()), 5, "every child to be gone")


def test_one_signal_delivered_twice_keeps_the_grace_period(tmp_path: Path) -> None:
    """`uv run` passes on a SIGTERM/SIGINT its child's group already had (stdin not a terminal):
    that repeat is not a second signal, and a child that cleans up gets its grace period (it was
    SIGKILLed at once, its shared-memory segments left behind)."""
    specs = [{"name": "tidy", "argv": child("tidy", tmp_path / "cleaned", 1.0)}]
    launcher, pids = start_launcher(tmp_path, specs, grace_s=20)
    log = tmp_path / "logs" / "tidy.log"
    wait_for(lambda: log.is_file() and "running" in log.read_text(), 10, "the child to set its handler")
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # two deliveries (sent together, the kernel would merge them into one)
    launcher.send_signal(signal.SIGTERM)
    rest, _ = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "SIGKILL" not in rest and rest.count("stopping tidy") == 1, rest
    assert (tmp_path / "cleaned").read_text() == "cleaned up"


def test_second_signal_skips_the_grace_period(tmp_path: Path) -> None:
    specs = [{"name": "stubborn", "argv": child("stubborn", tmp_path / "pid")}]
    launcher, pids = start_launcher(tmp_path, specs, grace_s=25)
    wait_for((tmp_path / "pid").exists, 10, "the stubborn child to ignore SIGTERM")

    launcher.send_signal(signal.SIGTERM)
    assert launcher.stdout is not None
    for line in launcher.stdout:
        if "stopping stubborn" in line:
            break
    time.sleep(REPEAT_S)  # (sooner, the same signal counts as the first one delivered twice)
    start = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    rest, _ = launcher.communicate(timeout=10)

    assert time.monotonic() - start < 5, "the second signal must not wait out the 25 s grace period"
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "stubborn still running (a second signal); sending SIGKILL" in rest
    assert not alive(pids["stubborn"])


def test_a_job_that_exits_0_before_its_share_is_done_stops_the_run_at_once(tmp_path: Path) -> None:
    """An orchestrator exiting 0 before the last step's rollouts left the trainer waiting out
    trainer.rollout_timeout_s (600 s), then the trainer was blamed."""
    specs = [
        ProcessSpec("trainer", child("job", "trainer", 1, 0, 120)),
        ProcessSpec(
            "orchestrator",
            child("job", "orch", 1, 0, 0.2),
            check_done=lambda: "before writing the rollouts of step 9",
        ),
    ]
    start = time.monotonic()
    code, out, sup = supervise(specs, tmp_path, shutdown_grace_s=5)

    assert code == 1 and time.monotonic() - start < 20, out
    log = tmp_path / "logs" / "orchestrator.log"
    assert out.splitlines()[-1] == (
        f"[rl] orchestrator failed: exited 0 before writing the rollouts of step 9 (log {log})"
    )
    assert not any(alive(c.popen.pid) for c in sup.children)


def test_a_job_whose_share_is_done_may_finish_first(tmp_path: Path) -> None:
    specs = [
        ProcessSpec("trainer", child("job", "trainer", 1, 0, 1.0)),
        ProcessSpec("orchestrator", child("job", "orch", 1, 0, 0), check_done=lambda: None),
    ]
    code, out, _ = supervise(specs, tmp_path)
    assert code == 0 and "orchestrator finished" in out and "trainer finished" in out, out


@pytest.mark.timeout(60)  # the child blocked on a full pipe forever
def test_a_log_that_cannot_be_opened_does_not_block_its_process(tmp_path: Path) -> None:
    """The pump opened the log before draining; when that failed (a full disk) its thread died,
    nothing read the child's pipe any more, and the child blocked once the pipe was full."""
    (tmp_path / "logs" / "trainer.log").mkdir(parents=True)  # (open() fails on it, as on a full disk)
    specs = [ProcessSpec("trainer", child("job", "trainer", 20_000, 0, 0))]  # far more than a pipe buffers
    code, out, _ = supervise(specs, tmp_path)
    assert code == 0, out[-2000:]
    assert (
        f"cannot write {tmp_path / 'logs' / 'trainer.log'}" in out and "[trainer] trainer line 19999" in out
    )


def test_sighup_to_launcher_stops_the_run_like_sigterm(tmp_path: Path) -> None:
    """A closed terminal or ssh session (SIGHUP) killed the launcher at once: no message, the
    children stopped by the kernel's SIGTERM without a grace period, their logs cut short."""
    specs = [{"name": "tidy", "argv": child("tidy", tmp_path / "cleaned", 0.5)}]
    # SIGHUP's default action, whatever the test run inherited (under `nohup`, ignored: the case below)
    default = lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)  # noqa: E731
    launcher, pids = start_launcher(tmp_path, specs, grace_s=20, preexec_fn=default)
    log = tmp_path / "logs" / "tidy.log"
    wait_for(lambda: log.is_file() and "running" in log.read_text(), 10, "the child to set its handler")

    launcher.send_signal(signal.SIGHUP)
    rest, _ = launcher.communicate(timeout=20)

    assert launcher.returncode == 128 + signal.SIGHUP, rest
    assert "received SIGHUP; stopping" in rest and "stopping tidy" in rest
    assert (tmp_path / "cleaned").read_text() == "cleaned up"
    assert not alive(pids["tidy"])


def test_an_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """`nohup rl ...`: the launcher keeps running through SIGHUP."""
    specs = [{"name": "trainer", "argv": child("job", "trainer", 1, 0, 120)}]
    ignore = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731 (as nohup does)
    launcher, pids = start_launcher(tmp_path, specs, grace_s=5, preexec_fn=ignore)

    launcher.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert launcher.poll() is None and alive(pids["trainer"])
    launcher.send_signal(signal.SIGTERM)
    rest, _ = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM and "SIGHUP" not in rest


def test_children_of_a_killed_launcher_stop_and_hold_its_lock_until_they_have(tmp_path: Path) -> None:
    """SIGKILL of the launcher: its children get SIGTERM from the kernel and stop. Until the last
    has, run_dir/rl.lock stays held (the lock was the launcher's alone: a --resume started at once
    ran beside a process still cleaning up), and the next launcher waits for them, saying so."""
    from tandem.transport.layout import run_dir_lock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()
    specs = [
        {"name": "inference", "argv": child("service", port), "role": "service",
         "health_url": f"http://127.0.0.1:{port}/health"},
        {"name": "tidy", "argv": child("tidy", tmp_path / "cleaned", 2.0)},
    ]  # fmt: skip
    launcher, pids = start_launcher(tmp_path, specs, grace_s=20, run_dir=run_dir)
    log = tmp_path / "logs" / "tidy.log"
    wait_for(lambda: log.is_file() and "running" in log.read_text(), 10, "the child to set its handler")

    launcher.kill()
    launcher.wait(timeout=10)
    said: list[str] = []
    with run_dir_lock(run_dir, wait_s=20, say=said.append):
        assert (tmp_path / "cleaned").read_text() == "cleaned up", (
            "the lock was free before the child had exited"
        )
    assert len(said) == 1 and f"the rl launcher (pid {launcher.pid}) is gone" in said[0], said
    assert str(pids["tidy"]) in said[0]
    wait_for(lambda: not any(alive(p) for p in pids.values()), 10, "every child to be gone")


def test_a_child_of_a_killed_launcher_that_will_not_stop_is_named(tmp_path: Path) -> None:
    from tandem.cli import UserError
    from tandem.transport.layout import run_dir_lock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    specs = [{"name": "stubborn", "argv": child("stubborn", tmp_path / "pid")}]
    launcher, pids = start_launcher(tmp_path, specs, grace_s=5, run_dir=run_dir)
    wait_for((tmp_path / "pid").exists, 10, "the stubborn child to ignore SIGTERM")
    launcher.kill()
    launcher.wait(timeout=10)
    try:
        with pytest.raises(UserError) as error, run_dir_lock(run_dir, wait_s=1):
            pass
        message = str(error.value)
        assert (
            f"still locked by processes the rl launcher (pid {launcher.pid}) left when it was killed"
            in message
        )
        assert f"{pids['stubborn']} (" in message and "children.py stubborn" in message
    finally:
        os.kill(pids["stubborn"], signal.SIGKILL)


def test_a_child_whose_launcher_died_before_it_was_set_up_exits(tmp_path: Path) -> None:
    """The kernel's SIGTERM on the launcher's death is armed in the child after the fork: a
    launcher that died before that left a child that ran on alone."""
    import functools

    from tandem.launch.supervisor import _die_with_parent

    marker = tmp_path / "ran"
    orphan = subprocess.Popen(
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        preexec_fn=functools.partial(_die_with_parent, os.getppid()),  # (not the child's parent: gone)
    )
    assert orphan.wait(timeout=30) == 1 and not marker.exists()


def test_a_failure_on_a_full_disk_says_so(tmp_path: Path) -> None:
    """A process that failed because run_dir's disk was full often said nothing about it (the
    trainer's checkpoint writer: "unexpected pos 704 vs 598"). (A full disk cannot be made here:
    the threshold is raised instead.)"""
    specs = [ProcessSpec("trainer", child("job", "trainer", 1, 1, 0))]
    out = io.StringIO()
    sup = Supervisor(specs, tmp_path / "logs", console=Console(out, colour=False), low_disk_bytes=1 << 62)
    assert sup.run() == 1
    last = out.getvalue().splitlines()[-1]
    assert re.fullmatch(
        rf"\[rl\] trainer failed: exit code 1; the filesystem of {tmp_path / 'logs'} has \d+ MiB free "
        rf"\(log {tmp_path / 'logs' / 'trainer.log'}\)",
        last,
    ), last
