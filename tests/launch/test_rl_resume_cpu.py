"""`rl --resume` on CPU after the run's processes stopped: after the trainer was SIGKILLed mid-run
(the failure's last lines, then every step trained), and after the orchestrator had written every
step's rollouts (the trainer retrains from its checkpoint)."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import CPU_ENV, alive, launch_rl, run_rl, tiny_rl_config

from tandem.models.tiny import build_tiny_model
from tandem.monitor.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_a_resume_with_every_step_written_retrains_them_and_finishes(tmp_path: Path) -> None:
    """The trainer stopped in the last steps, after the orchestrator (which runs ahead) wrote
    every step: --resume retrains from the checkpoint on the written rollouts, and the servers
    still take each version it sends in memory (the orchestrator used to return at once, and the
    trainer then waited out transfer_timeout_s for servers nobody told to receive)."""
    keep = ("--max_steps", "4", "--trainer.ckpt.interval", "2", "--trainer.prune_rollouts", "false")
    _, run = run_rl(tmp_path, *keep)
    for kind in ("checkpoints", "weights"):  # what a kill in step 3 leaves
        shutil.rmtree(run / kind / "step_4")
    out = launch_rl(tmp_path, *keep, "--resume")
    assert "all 4 steps are already written; the trainer retrains them from step 2" in out
    assert "[trainer] step 3 (4/4)" in out and (run / "weights" / "step_4" / "STABLE").is_file()
    assert "received policy version 4" in (run / "logs" / "inference.log").read_text()


def test_a_killed_trainer_stops_the_run_in_one_line_and_resume_loses_no_step(tmp_path: Path) -> None:
    """SIGKILL of the trainer mid-run: the servers and the orchestrator are stopped, the last
    lines name the trainer with its log and the step --resume continues from; the resumed run
    trains every step."""
    model = build_tiny_model(
        out=tmp_path / "model", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128
    )
    run = tmp_path / "run"
    (tmp_path / "rl.toml").write_text(
        tiny_rl_config(model, run, max_steps=40, extra="[trainer.ckpt]\ninterval = 1")
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tandem.launch.cli", "@", str(tmp_path / "rl.toml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=CPU_ENV,
    )
    assert launcher.stdout is not None
    lines, pids = [], {}
    for line in launcher.stdout:
        lines.append(line)
        if m := re.search(r"started (\w+) \(pid (\d+)\)", line):
            pids[m[1]] = int(m[2])
        if re.match(r"\[trainer\] step 3 ", line):
            os.kill(pids["trainer"], signal.SIGKILL)
            break
    rest, _ = launcher.communicate(timeout=60)
    out = "".join(lines) + rest
    assert launcher.returncode == 1, out[-4000:]
    last = out.splitlines()[-2:]
    assert last[0] == f"[rl] trainer failed: killed by SIGKILL (log {run / 'logs' / 'trainer.log'})", last
    assert re.fullmatch(
        r"\[rl\] stopped; `rl \.\.\. --resume` continues this run_dir from its checkpoint of step \d+",
        last[1],
    )
    assert (run / "logs" / "FAILED").read_text() == f"rl: {last[0][5:]}\n"
    assert not any(alive(p) for p in pids.values())

    launch_rl(tmp_path, "--resume")
    trained = {r["step"] for r in read_metrics(run / "metrics.jsonl", "trainer")}
    assert trained == set(range(40))
