"""Exact resume: a trainer process killed mid-run and restarted with --resume publishes the same
weights as an uninterrupted run, step for step."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rl_helpers import sample_reverse_text, small_model, write_rollouts
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem.config import parse_config
from tandem.models.loading import load_tokenizer
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.train import train
from tandem.transport.weights import STABLE, weights_dir

STEPS = 6
TEMPERATURE = 1.0


def args(model: Path, run_dir: Path) -> list[str]:
    settings = {
        "model.name": model,
        "model.device": "cpu",
        "run_dir": run_dir,
        "max_steps": STEPS,
        "optim.lr": 3e-3,
        "optim.schedule": "cosine",
        "optim.warmup_steps": 2,
        "optim.weight_decay": 0.01,
        "ckpt.interval": 2,
        "ckpt.keep": 0,
        "weights.keep": 0,
        "rollout_timeout_s": 60,
        "loss.type": "ppo_clip",
        "loss.kl_coef": 0.01,
    }
    return [part for key, value in settings.items() for part in (f"--{key}", str(value))]


def weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    return load_file(weights_dir(run_dir, version) / "model.safetensors")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny model and a run directory holding rollouts for every step (sampled from the base model)."""
    root = tmp_path_factory.mktemp("resume")
    model_dir = small_model(root / "tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(model_dir))
    rollouts = root / "rollouts_only"
    for step in range(STEPS):
        samples = sample_reverse_text(model, tokenizer, 2, 4, TEMPERATURE, 12, seed=step)
        write_rollouts(rollouts, step, samples, TEMPERATURE)
    return model_dir, rollouts


def test_killed_and_resumed_run_publishes_identical_weights(
    prepared: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, rollouts = prepared
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    shutil.copytree(rollouts, reference)
    shutil.copytree(rollouts, interrupted)
    train(parse_config(RLTrainerConfig, args(model_dir, reference)))

    command = [sys.executable, "-m", "tandem.trainer.rl.cli", *args(model_dir, interrupted)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while not (weights_dir(interrupted, 3) / STABLE).exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "trainer did not publish weights/step_3 in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (weights_dir(interrupted, STEPS) / STABLE).exists(), "the run finished before it was killed"

    done = subprocess.run(command + ["--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from" in done.stdout and "checkpoints/step_" in done.stdout

    for version in range(1, STEPS + 1):
        want, got = weights(reference, version), weights(interrupted, version)
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), f"weights/step_{version}: {name} differs"
    assert not torch.equal(
        weights(reference, 1)["model.norm.weight"], weights(reference, STEPS)["model.norm.weight"]
    )
