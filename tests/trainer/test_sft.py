"""SFT end to end on a tiny model: the loss goes down, checkpoints resume exactly."""

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.cli import UserError
from tandem.config import build_config
from tandem.config.loader import split_args
from tandem.monitor.metrics import read_metrics
from tandem.trainer.sft.config import SFTConfig
from tandem.trainer.sft.train import train

sys.path.insert(0, str(Path(__file__).parent))
from test_sft_helpers import ENV, sft_args, tiny_model  # noqa: E402

SFT = str(Path(sys.executable).parent / "sft")


def config(argv: list[str]) -> SFTConfig:
    _, overrides, _ = split_args(argv)
    return build_config(SFTConfig, overrides=overrides)


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step logged twice (before a crash and after resuming) keeps the last value."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", "sft") if "loss" in r}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 12-step run with checkpoints every 4 steps."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    args = sft_args(
        model, run_dir, steps=12, **{"ckpt.interval": 4, "eval.final": True, "eval.num-tasks": 20}
    )
    summary = train(config(args))
    assert summary["steps"] == 12
    return run_dir


def test_short_run_lowers_loss_and_writes_outputs(reference: Path) -> None:
    rows = read_metrics(reference / "metrics.jsonl", "sft")
    records = [r for r in rows if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    evaluations = [r for r in rows if "eval/reward" in r]  # the final held-out evaluation
    assert [r["step"] for r in evaluations] == [12]
    assert 0 <= evaluations[0]["eval/exact_match"] <= evaluations[0]["eval/reward"] <= 1
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 1.0, (first, last)
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0 for r in records)
    assert records[0]["lr"] == pytest.approx(3e-3 / 2)  # first warmup step
    assert [p.name for p in sorted((reference / "checkpoints").iterdir())] == ["step_12", "step_4", "step_8"]
    final = AutoModelForCausalLM.from_pretrained(reference / "final")  # a plain transformers model
    assert sum(p.numel() for p in final.parameters()) > 0
    ckpt = reference / "checkpoints" / "step_12"
    assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "trainer_state.pt").is_file()


def test_interrupted_run_resumes_to_the_same_losses(model: Path, reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = sft_args(model, run_dir, steps=12, **{"ckpt.interval": 4})
    proc = subprocess.Popen([SFT, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 400  # generous: the CI box is shared
    while not (run_dir / "checkpoints" / "step_4").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:] if proc.stdout else ""
        assert time.monotonic() < deadline, "no checkpoint after 400 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (run_dir / "final").exists(), "the run finished before it could be interrupted"
    resumed_from = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert resumed_from < 12

    train(config([*args, "--resume"]))
    expected, got = losses(reference), losses(run_dir)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    for name, weight in AutoModelForCausalLM.from_pretrained(reference / "final").state_dict().items():
        torch.testing.assert_close(final[name], weight, rtol=0, atol=1e-6)


def test_resume_before_the_first_checkpoint_trains_from_step_0(
    model: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    train(config([*sft_args(model, run_dir, steps=2), "--resume"]))
    assert "no checkpoint in" in capsys.readouterr().out and sorted(losses(run_dir)) == [1, 2]
    assert losses(run_dir)[1] == pytest.approx(losses(reference)[1], abs=1e-6)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["--seed", "1"], "seed was 0 there, the run has 1"),
        (["--data.num-examples", "100"], "data.num_examples"),
    ],
)
def test_resume_on_other_data_fails_naming_what_changed(
    model: Path, reference: Path, tmp_path: Path, change: list[str], named: str
) -> None:
    """(Without the check the run went on at the saved position of another data order: examples seen
    twice or never, silently.)"""
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "checkpoints" / "step_4", run_dir / "checkpoints" / "step_4")
    with pytest.raises(UserError, match="cannot resume from .*step_4: " + re.escape(named)):
        train(config([*sft_args(model, run_dir, steps=6), "--resume", *change]))
