"""The whole `rl` command on CPU: a real inference server, orchestrator and trainer, two steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import alive, tiny_rl_config

from tandem.models.tiny import build_tiny_model
from tandem.monitor.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_rl_runs_two_steps_on_cpu(tmp_path: Path) -> None:
    model = build_tiny_model(
        out=tmp_path / "model", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128
    )
    run = tmp_path / "run"
    (tmp_path / "rl.toml").write_text(tiny_rl_config(model, run, max_steps=2))
    result = subprocess.run(
        [sys.executable, "-m", "tandem.launch.cli", "@", str(tmp_path / "rl.toml")],
        capture_output=True,
        text=True,
        timeout=480,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]

    assert (
        "[rl] inference is healthy" in out
        and "[trainer] step 2/2" in out
        and "[orchestrator] step 2/2" in out
    )
    assert f"final weights: {run / 'weights' / 'step_2'}" in out
    assert (run / "weights" / "step_2" / "STABLE").is_file()
    assert sorted(p.name for p in (run / "configs").iterdir()) == [
        "inference_0.toml",
        "orchestrator.toml",
        "rl.toml",
        "trainer.toml",
    ]
    assert "step 2/2" in (run / "logs" / "trainer.log").read_text()
    assert "Uvicorn running" in (run / "logs" / "inference.log").read_text()
    pids = [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", out)]
    assert len(pids) == 3 and not any(alive(p) for p in pids)

    # Stopped before its first checkpoint (none are configured): a fresh start into the same
    # run_dir is refused in one line, --resume trains again from step 0, with repeats marked.
    launch = [sys.executable, "-m", "tandem.launch.cli", "@", str(tmp_path / "rl.toml"), "--max_steps", "3"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    fresh = subprocess.run(launch, capture_output=True, text=True, timeout=120, env=env)
    assert fresh.returncode == 2 and "pass --resume to continue that run (from step 0" in fresh.stderr
    resumed = subprocess.run([*launch, "--resume"], capture_output=True, text=True, timeout=480, env=env)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert "training again from step 0" in out and "[trainer] step 3/3" in out
    trainer = read_metrics(run / "metrics.jsonl", "trainer")
    assert [(r["step"], r.get("attempt", 1)) for r in trainer] == [(0, 1), (1, 1), (0, 2), (1, 2), (2, 1)]
