"""The whole `rl` command on CPU: real inference servers, orchestrator and trainer, two steps; with
the default transport (auto: colocated through shared memory on one host), a resume before the
first checkpoint, a 2-rank FSDP trainer broadcasting (gloo) to two servers, and a prefill server
computing two decode servers' prompts. Resumes after a kill and after the last step:
test_rl_resume_cpu.py (a file of its own, so that CI's two workers share these long runs)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import CPU_ENV, alive, run_rl

from tandem.monitor.metrics import read_metrics
from tandem.transport.weights import stable_versions

pytestmark = pytest.mark.slow


def test_rl_runs_two_steps_on_cpu(tmp_path: Path) -> None:
    out, run = run_rl(tmp_path)
    assert (
        "[rl] inference is healthy" in out
        and "[trainer] step 1 (2/2)" in out
        and "[orchestrator] step 1 (2/2)" in out
    )
    # the console's last line names the last record's step; what it produced is named by steps done
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl", "trainer")] == [0, 1]
    assert "trainer: weights by auto (server 0: colocated from rank 0" in out
    assert f"final weights: {run / 'weights' / 'step_2'}" in out
    assert (run / "weights" / "step_2" / "STABLE").is_file()
    assert sorted(p.name for p in (run / "configs").iterdir()) == [
        "inference_0.toml",
        "orchestrator.toml",
        "rl.toml",
        "trainer.toml",
    ]
    assert "step 1 (2/2)" in (run / "logs" / "trainer.log").read_text()
    assert "Uvicorn running" in (run / "logs" / "inference.log").read_text()
    pids = [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", out)]
    assert len(pids) == 3 and not any(alive(p) for p in pids)

    # Stopped before its first checkpoint (none are configured): a fresh start into the same
    # run_dir is refused in one line, --resume trains again from step 0, with repeats marked.
    launch = [sys.executable, "-m", "tandem.launch.cli", "@", str(tmp_path / "rl.toml"), "--max_steps", "3"]
    fresh = subprocess.run(launch, capture_output=True, text=True, timeout=120, env=CPU_ENV)
    assert fresh.returncode == 2 and "pass --resume to continue that run (from step 0" in fresh.stderr
    resumed = subprocess.run([*launch, "--resume"], capture_output=True, text=True, timeout=480, env=CPU_ENV)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert "training again from step 0" in out and "[trainer] step 2 (3/3)" in out
    trainer = read_metrics(run / "metrics.jsonl", "trainer")
    assert [(r["step"], r.get("attempt", 1)) for r in trainer] == [(0, 1), (1, 1), (0, 2), (1, 2), (2, 1)]


def test_two_rank_trainer_broadcasts_to_two_servers(tmp_path: Path) -> None:
    out, run = run_rl(
        tmp_path,
        *("--deployment.inference_servers", "2", "--deployment.trainer_nproc", "2"),
        *("--weights.transport", "broadcast", "--weights.transfer_timeout_s", "120"),
        *("--orchestrator.batch_size", "8", "--orchestrator.max_async_level", "0"),
    )
    assert "trainer: weights by broadcast (server 0: broadcast, server 1: broadcast" in out
    for i in range(2):
        assert (
            "received policy version 2 (broadcast group rank"
            in (run / "logs" / f"inference_{i}.log").read_text()
        )
    trainer = read_metrics(run / "metrics.jsonl", "trainer")
    assert [r["step"] for r in trainer] == [0, 1]
    assert all(r["mismatch_kl"] <= 1e-6 and r["staleness"] == 0 for r in trainer), trainer
    assert stable_versions(run) == [2]


def test_a_prefill_server_computes_the_decode_servers_prompts(tmp_path: Path) -> None:
    """Two decode servers and one prefill server: the prefill server takes every weight version
    with the others (colocated transport to 3 servers) and computes their prompts."""
    out, run = run_rl(
        tmp_path,
        *("--deployment.inference_servers", "3", "--deployment.prefill_servers", "1"),
        *("--inference.prefill.min_tokens", "16", "--orchestrator.max_async_level", "0"),
    )
    assert "their prompts computed by: http://127.0.0.1:" in (run / "logs" / "orchestrator.log").read_text()
    for i in range(3):
        assert "received policy version 2" in (run / "logs" / f"inference_{i}.log").read_text()
    computed = [
        re.search(
            r"prefill servers computed (\d+) prompt\(s\)", (run / "logs" / f"inference_{i}.log").read_text()
        )
        for i in range(2)
    ]
    assert all(m is not None for m in computed), out[-3000:]
    assert (
        sum(int(m.group(1)) for m in computed if m) >= 4
    )  # (both steps: 2 groups each, one request per group)
    trainer = read_metrics(run / "metrics.jsonl", "trainer")
    assert [r["step"] for r in trainer] == [0, 1]
    assert all(r["mismatch_kl"] <= 1e-6 for r in trainer), trainer
