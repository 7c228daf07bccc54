"""torchrun's c10d rendezvous across two "nodes" on 127.0.0.1: two agents (`--nnodes 2`, one CPU
rank each, started with the launcher's own torchrun command) train the SFT and the RL trainer
exactly as one node with two ranks does."""

import subprocess
from pathlib import Path

import pytest
import torch
from process_output import failure
from rl_helpers import sample_reverse_text, small_model, write_rollouts
from test_sft_helpers import ENV, sft_args, tiny_model
from transformers import AutoModelForCausalLM

from tandem.launch.plan import torchrun_command
from tandem.models.loading import load_tokenizer
from tandem.monitor.metrics import read_metrics
from tandem.net import free_port

pytestmark = pytest.mark.slow  # (tests/conftest.py hands this file out first)


def one_node_two_ranks(module: str, args: list[str]) -> None:
    done = subprocess.run(
        [*torchrun_command(2), "-m", module, *args], capture_output=True, text=True, env=ENV, timeout=400
    )
    assert done.returncode == 0, failure(done)


def two_nodes_one_rank_each(module: str, args: list[str]) -> None:
    agent = [*torchrun_command(1, 2, f"127.0.0.1:{free_port()}", join_timeout_s=120), "-m", module, *args]
    agents = [
        subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=400)[0] for a in agents]
    for a, out in zip(agents, outputs, strict=True):
        assert a.returncode == 0, out[-3000:]


def test_sft_on_two_nodes_matches_one_node(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    small = {"data.num-examples": 64, "data.batch-size": 8}
    one_node_two_ranks("tandem.trainer.sft.cli", sft_args(model, tmp_path / "one", steps=3, **small))
    two_nodes_one_rank_each("tandem.trainer.sft.cli", sft_args(model, tmp_path / "two", steps=3, **small))
    one = read_metrics(tmp_path / "one" / "metrics.jsonl", "sft")
    two = read_metrics(tmp_path / "two" / "metrics.jsonl", "sft")
    assert len(one) == len(two) == 3 and one[-1]["loss"] != one[0]["loss"]
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6, (a, b)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final").state_dict()
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final").state_dict()
    for name, weight in want.items():
        torch.testing.assert_close(got[name], weight, rtol=0, atol=1e-6, msg=name)


def test_rl_trainer_on_two_nodes_matches_one_node(tmp_path: Path) -> None:
    model_dir = small_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(model_dir))
    one, two = tmp_path / "one", tmp_path / "two"
    for step in range(2):
        samples = sample_reverse_text(model, tokenizer, 3, 3, 1.0, 6 + 10 * step, seed=step)
        write_rollouts(one, step, samples, 1.0, num_ranks=2)
        write_rollouts(two, step, samples, 1.0, num_ranks=2)

    def args(run_dir: Path) -> list[str]:
        settings = {"model.name": model_dir, "model.device": "cpu", "run_dir": run_dir, "max_steps": 2}
        settings |= {"optim.lr": 1e-3, "rollout_timeout_s": 60, "logprob_chunk_size": 32}
        return [part for key, value in settings.items() for part in (f"--{key}", str(value))]

    one_node_two_ranks("tandem.trainer.rl.cli", args(one))
    two_nodes_one_rank_each("tandem.trainer.rl.cli", args(two))
    for a, b in zip(read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl"), strict=True):
        assert a["samples"] == b["samples"] == 9 and a["loss_tokens"] == b["loss_tokens"]
        for key in ("loss", "grad_norm", "mismatch_kl", "entropy"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a[key], b[key])
