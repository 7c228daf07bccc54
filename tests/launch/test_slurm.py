"""`rl @ cfg.toml` with [slurm] against a real Slurm on localhost (slurm_cluster.py): the rendered
script is submitted with sbatch and runs a 3-step CPU reverse-text RL run on one node; on two nodes
(inference + orchestrator on one, the trainer on the other) a failing process ends the job with a
message naming its node and process. Trainers across nodes (c10d) are tested without Slurm in
tests/trainer/test_multinode.py: a three-node job here cost 67 s of CI."""

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_helpers import tiny_rl_config
from slurm_cluster import LocalSlurm, missing_reason

from tandem.launch.cli import main
from tandem.models.tiny import build_tiny_model
from tandem.net import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    if reason := missing_reason():
        pytest.skip(reason)
    cluster = LocalSlurm()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("slurm_model") / "model"
    return build_tiny_model(out=out, num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128)


def write_config(tmp_path: Path, model: Path, extra: str = "", run: str = "run") -> Path:
    slurm = '[slurm]\ntime = "00:15:00"\nexclusive = false\nenv = { CUDA_VISIBLE_DEVICES = "" }\n'
    path = tmp_path / "rl.toml"
    path.write_text(tiny_rl_config(model, tmp_path / run, max_steps=3, extra=slurm + extra))
    return path


def submit(slurm: LocalSlurm, config: Path, capsys: pytest.CaptureFixture) -> tuple[str, dict[str, str]]:
    """`rl @ config` (in this process; it calls sbatch); the job id and the job's final state."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        main(["@", str(config)])
    out = capsys.readouterr().out
    match = re.search(r"\[rl\] submitted Slurm job (\d+) \((\d) node\(s\)\)", out)
    assert match, out
    return match.group(1), slurm.wait_job(match.group(1), timeout_s=480)


def cluster_section(trainer_nodes: int = 1) -> str:
    ports = f"rdzv_port = {free_port()}\nweights_group_port = {free_port()}\n"
    return f"[cluster]\ninference_nodes = 1\ntrainer_nodes = {trainer_nodes}\njoin_timeout_s = 120\n{ports}"


def test_one_node_job_trains_three_steps(slurm: LocalSlurm, model: Path, tmp_path: Path, capsys) -> None:
    # a space and a '#' in run_dir: #SBATCH values are quoted (a space ended one, '#' began a comment)
    job, state = submit(slurm, write_config(tmp_path, model, run="my run #1"), capsys)
    run = tmp_path / "my run #1"
    output = (run / "logs" / f"slurm-{job}.out").read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert (run / "weights" / "step_3" / "STABLE").is_file()
    assert f"[rl] finished 3 steps; final weights: {run / 'weights' / 'step_3'}" in output
    assert (run / "slurm" / "job.sbatch").is_file() and (run / "configs" / "trainer.toml").is_file()


def test_a_failing_process_ends_the_job_naming_node_and_process(
    slurm: LocalSlurm, model: Path, tmp_path: Path, capsys
) -> None:
    # The trainer gives up on rollouts after 1 s, long before the server is up.
    extra = cluster_section() + "[trainer]\nrollout_timeout_s = 1\n"
    job, state = submit(slurm, write_config(tmp_path, model, extra), capsys)
    run = tmp_path / "run"
    output = (run / "logs" / f"slurm-{job}.out").read_text()
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", output[-4000:]
    assert "tandem: node addresses 127.0.0.1,127.0.0.1" in output  # derived from Slurm, not typed
    log = run / "logs" / "trainer-0" / "trainer.log"
    assert f"tandem: rl trainer-0 (127.0.0.1): trainer failed: exit code 2 (log {log})" in output
    assert re.search(
        r"\[rl inference-0 \(127\.0\.0\.1\)\] stopping: trainer-0 \(127\.0\.0\.1\): trainer failed", output
    )
    assert not (run / "logs" / "inference-0" / "FAILED").exists()  # stopped for trainer-0, not failed


def test_dry_run_without_submitting(
    slurm: LocalSlurm, model: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    before = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=slurm.env).stdout
    main(["@", str(write_config(tmp_path, model)), "--dry-run"])
    assert "submit it with: sbatch" in capsys.readouterr().out
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=slurm.env).stdout == before
