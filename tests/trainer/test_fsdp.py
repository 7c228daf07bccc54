"""FSDP2 on two CPU processes (torchrun, gloo) trains exactly like one process."""

import shutil
import subprocess
import sys
from pathlib import Path

import torch
from process_output import failure
from transformers import AutoModelForCausalLM

from tandem.config import build_config
from tandem.config.loader import split_args
from tandem.monitor.metrics import read_metrics
from tandem.trainer.sft.config import SFTConfig
from tandem.trainer.sft.train import train

sys.path.insert(0, str(Path(__file__).parent))
from test_sft_helpers import ENV, sft_args, tiny_model  # noqa: E402


def test_two_ranks_match_one(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    # Clipping is active (grad norms exceed 0.5), so the sharded global norm is checked too.
    args = sft_args(model, tmp_path / "two", steps=4, **{"optim.max-grad-norm": 0.5})
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.Popen(
        [*launch, "-m", "tandem.trainer.sft.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    _, overrides, _ = split_args(sft_args(model, tmp_path / "one", steps=4, **{"optim.max-grad-norm": 0.5}))
    train(build_config(SFTConfig, overrides=overrides))
    out, _ = two.communicate(timeout=400)
    assert two.returncode == 0, out[-3000:]
    assert "(2 ranks)" in out

    one = read_metrics(tmp_path / "one" / "metrics.jsonl", "sft")
    two_ranks = read_metrics(tmp_path / "two" / "metrics.jsonl", "sft")
    assert len(one) == len(two_ranks) == 4
    for a, b in zip(one, two_ranks, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a, b)
    assert max(r["grad_norm"] for r in one) > 0.5
    assert one[-1]["loss"] < one[0]["loss"]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final").state_dict()
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final").state_dict()
    assert reference.keys() == sharded.keys()
    for name, weight in reference.items():
        torch.testing.assert_close(sharded[name], weight, rtol=0, atol=1e-5)
    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert any(not torch.equal(initial[n], w) for n, w in reference.items()), "training changed nothing"


def test_resume_on_another_world_size(tmp_path: Path) -> None:
    """A checkpoint written by 2 ranks resumes on 1 (DCP reshards): the same losses as 1 rank throughout."""
    model = tiny_model(tmp_path)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = sft_args(model, tmp_path / "moved", steps=6, **{"ckpt.interval": 3})
    done = subprocess.run(
        [*launch, "-m", "tandem.trainer.sft.cli", *args], capture_output=True, text=True, env=ENV, timeout=400
    )
    assert done.returncode == 0, failure(done)
    shutil.rmtree(tmp_path / "moved" / "checkpoints" / "step_6")  # as if the 2-rank run had died after step 3
    _, overrides, _ = split_args([*args, "--resume"])
    train(build_config(SFTConfig, overrides=overrides))
    _, overrides, _ = split_args(sft_args(model, tmp_path / "one", steps=6))
    train(build_config(SFTConfig, overrides=overrides))

    one = {
        r["step"]: r["loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl", "sft") if "loss" in r
    }
    # a step logged twice (by the 2-rank run, then after the resume) keeps its last value
    moved = {
        r["step"]: r["loss"] for r in read_metrics(tmp_path / "moved" / "metrics.jsonl", "sft") if "loss" in r
    }
    assert sorted(moved) == sorted(one) == list(range(1, 7))
    for step in one:
        assert abs(one[step] - moved[step]) <= 1e-5, step
