"""Shared helpers of the launcher tests: a tiny run's config, `rl` on it, stand-in processes, pid
checks, environments whose training split the launcher must refuse."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.envs.reverse_text_env import ReverseTextEnv
from tandem.envs.wordle import WordleEnv
from tandem.models.tiny import build_tiny_model
from tandem.net import free_ports

CHILDREN = str(Path(__file__).with_name("children.py"))


def tiny_rl_config(model: Path, run_dir: Path, max_steps: int, extra: str = "") -> str:
    """The TOML of a small CPU RL run: a tiny model, 4 samples of at most 8 tokens per step."""
    return f"""
seq_len = 96
max_steps = {max_steps}
run_dir = "{run_dir}"
[model]
name = "{model}"
[deployment]
startup_timeout_s = 240
shutdown_grace_s = 5
[inference]
port = {free_ports()}
[orchestrator]
batch_size = 4
group_size = 2
micro_batch_tokens = 256
[orchestrator.sampling]
max_tokens = 8
[trainer.weights]
keep = 2
{extra}
"""


CPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run_rl(tmp_path: Path, *overrides: str) -> tuple[str, Path]:
    """`rl` on a tiny model for two steps; returns its output and the run directory."""
    model = build_tiny_model(
        out=tmp_path / "model", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128
    )
    run = tmp_path / "run"
    (tmp_path / "rl.toml").write_text(tiny_rl_config(model, run, max_steps=2))
    return launch_rl(tmp_path, *overrides), run


def launch_rl(tmp_path: Path, *overrides: str) -> str:
    """`rl @ tmp_path/rl.toml OVERRIDES`, which must succeed; its output."""
    result = subprocess.run(
        [sys.executable, "-m", "tandem.launch.cli", "@", str(tmp_path / "rl.toml"), *overrides],
        capture_output=True,
        text=True,
        timeout=480,
        env=CPU_ENV,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out


def child(mode: str, *args: object) -> list[str]:
    """argv of a stand-in process from children.py."""
    return [sys.executable, CHILDREN, mode, *(str(a) for a in args)]


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: nobody may reap orphans in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def scaled_reinforce(inputs, scale: float = 1.0):  # noqa: ANN001, ANN201 (a custom loss for preflight)
    from tandem.trainer.rl.loss import LossTerms

    return LossTerms(-scale * inputs.advantages * inputs.logprobs, inputs.advantages < 0)


class NoTrainingTasksEnv(ReverseTextEnv):
    """Single-turn, with an empty training split (as an import path: launch_helpers:NoTrainingTasksEnv)."""

    name = "no_tasks"

    def dataset(self, split):  # type: ignore[no-untyped-def]
        return [] if split == "train" else super().dataset(split)


class UnreadableTasksEnv(WordleEnv):
    """Multi-turn, whose training split's data file is missing."""

    name = "unreadable"

    def dataset(self, split):  # type: ignore[no-untyped-def]
        raise FileNotFoundError(2, "No such file or directory", "data/train.jsonl")
