"""`rl @ cfg.toml` with [slurm]: the rendered sbatch scripts, --dry-run, a user template, and bad
input (no sbatch on the machine, GPU counts that do not fit). The real Slurm runs are in
test_slurm.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config.loader import build_config
from tandem.launch.cli import main
from tandem.launch.cluster import resolve_cluster
from tandem.launch.config import RLConfig
from tandem.launch.plan import plan_node


def write_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "rl.toml"
    path.write_text(
        f"""
seq_len = 256
max_steps = 3
run_dir = "{tmp_path / "run"}"
[model]
name = "tiny"
[slurm]
partition = "gpu"
account = "proj"
time = "04:00:00"
sbatch = ["--qos=high", "#SBATCH --mem=0"]
env = {{ HF_HOME = "/shared/hf cache" }}
setup = ["module load cuda"]
{extra}
"""
    )
    return path


def run_rl(args: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # a machine without sbatch
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_single_node_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    assert run_rl(["@", str(write_config(tmp_path)), "--dry-run"], monkeypatch, tmp_path) == 0
    folder = tmp_path / "run" / "slurm"
    script = (folder / "job.sbatch").read_text()
    assert f"[rl] wrote {folder / 'job.sbatch'} (and job.toml beside it)" in capsys.readouterr().out
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        '#SBATCH --job-name="tandem-run"',
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        f'#SBATCH --chdir="{Path.cwd()}"',
        f'#SBATCH --output="{tmp_path / "run" / "logs" / "slurm-%j.out"}"',
        '#SBATCH --partition="gpu"',
        '#SBATCH --account="proj"',
        '#SBATCH --time="04:00:00"',
        "#SBATCH --exclusive",
        "#SBATCH --qos=high",
        "#SBATCH --mem=0",
    ]
    assert "export HF_HOME='/shared/hf cache'\n" in script and "set -e\nmodule load cuda\nset +e\n" in script
    launcher = f"{sys.executable} -m tandem.launch.node @ {folder / 'job.toml'}"
    assert f"srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1 {launcher}\n" in script
    assert "scontrol" not in script


def test_multi_node_script_and_the_config_the_nodes_read(tmp_path: Path, monkeypatch, capsys) -> None:
    extra = "[cluster]\ninference_nodes = 1\ntrainer_nodes = 2\ngpus_per_node = 8\nservers_per_node = 2\n"
    assert run_rl(["@", str(write_config(tmp_path, extra)), "--dry-run"], monkeypatch, tmp_path) == 0
    out = capsys.readouterr().out
    assert f"[rl] warning: run_dir {tmp_path / 'run'} is on a local" in out  # tmp is not shared
    folder = tmp_path / "run" / "slurm"
    script = (folder / "job.sbatch").read_text()
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert "# nodes 0..0 inference, 1..2 trainer.\n" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    launcher = f"{sys.executable} -m tandem.launch.node @ {folder / 'job.toml'}"
    assert (
        f'srun --nodes=3 --ntasks-per-node=1 --kill-on-bad-exit=1 {launcher} --cluster.hosts "$hosts"'
        in script
    )

    # what a node launcher does with it: the addresses come from the hosts the job found
    overrides = [("cluster.hosts", "n0,n1,n2")]
    job = build_config(RLConfig, files=[folder / "job.toml"], overrides=overrides)
    cluster = resolve_cluster(job)
    plan = plan_node(job, cluster, cluster.unit(2), [str(i) for i in range(8)])
    assert plan.orchestrator.servers == ["http://n0:8000", "http://n0:8001"]
    assert "--rdzv-endpoint=n1:29400" in plan.specs()[0].argv


def test_user_template_extends_the_packaged_one(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "mine.sbatch.j2").write_text(
        '{% extends "single_node.sbatch.j2" %}\n{% block launch %}\necho "mine on {{ nodes }} node"\n'
        "{{ super() }}{% endblock %}\n"
    )
    extra = f'template = "{tmp_path / "mine.sbatch.j2"}"\n'
    assert run_rl(["@", str(write_config(tmp_path, extra)), "--dry-run"], monkeypatch, tmp_path) == 0
    script = (tmp_path / "run" / "slurm" / "job.sbatch").read_text()
    assert 'echo "mine on 1 node"\n' in script and "srun --nodes=1 --ntasks=1" in script
    assert script.startswith("#!/bin/bash\n") and script.rstrip().endswith('exit "$status"')


def test_without_sbatch_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    assert run_rl(["@", str(write_config(tmp_path))], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "rl: error: the config has a [slurm] section but sbatch is not on this machine's PATH"
    )
    assert "pass --dry-run to only write the script" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "[cluster]\ninference_nodes = 1\ngpus_per_node = 8\nservers_per_node = 3\n",
            "rl: error: cluster.servers_per_node = 3 cannot split cluster.gpus_per_node = 8 GPUs evenly",
        ),
        (
            "[cluster]\ngpus_per_node = 1\n[deployment]\ntrainer_gpus = [0, 1]\n",
            "rl: error: deployment.trainer_gpus: GPU(s) 1 not visible (visible: 0)",
        ),
        ('template = "/nowhere/x.j2"\n', "rl: error: slurm.template: no such file /nowhere/x.j2"),
        ('job_name = "a\\nb"\n', "rl: error: a Slurm option value cannot hold a line break: 'a\\nb'"),
    ],
)
def test_bad_input_fails_before_anything_is_written(
    tmp_path: Path, monkeypatch, capsys, extra, message
) -> None:
    assert run_rl(["@", str(write_config(tmp_path, extra)), "--dry-run"], monkeypatch, tmp_path) == 2
    assert capsys.readouterr().err.strip() == message
    assert not (tmp_path / "run" / "slurm" / "job.sbatch").exists()


def test_both_schedulers_is_an_error(tmp_path: Path, monkeypatch, capsys) -> None:
    assert run_rl(["@", str(write_config(tmp_path)), "--k8s"], monkeypatch, tmp_path) == 2
    assert re.search(r"both \[slurm\] and \[kubernetes\]", capsys.readouterr().err)


@pytest.mark.parametrize("fails", [True, False])
def test_a_failed_setup_line_launches_nothing(tmp_path: Path, monkeypatch, fails: bool) -> None:
    """A [slurm] setup line that fails (a module that does not load, a missing venv) ends the job
    with one line before any node starts (they were launched anyway)."""
    setup = '["true", "false", "echo after"]' if fails else '["true", "echo after"]'
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace('setup = ["module load cuda"]', f"setup = {setup}"))
    assert run_rl(["@", str(config), "--dry-run"], monkeypatch, tmp_path) == 0
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text("#!/bin/sh\necho STUB srun\n")
    (stubs / "srun").chmod(0o755)
    done = subprocess.run(
        ["bash", str(tmp_path / "run" / "slurm" / "job.sbatch")],
        env={"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if fails:
        assert done.returncode == 1 and "STUB srun" not in done.stdout and "after" not in done.stdout
        assert "tandem: a [slurm] setup line failed (exit 1); nothing was launched" in done.stdout
    else:
        assert done.returncode == 0 and "after\n" in done.stdout and "STUB srun" in done.stdout, done.stdout
