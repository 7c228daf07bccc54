"""The RL trainer in-process on a tiny model: step-0 consistency with the sampler, a real update
that moves the policy the way the advantages say, published weights and metrics."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rl_helpers import sample_reverse_text, small_model, write_rollouts
from transformers import AutoModelForCausalLM

from tandem.config import build_config
from tandem.models.loading import load_tokenizer
from tandem.monitor.metrics import read_metrics
from tandem.trainer.logprobs import sequence_logprobs
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.train import train
from tandem.transport.rollouts import RolloutError, Sample, pack_samples
from tandem.transport.weights import STABLE, stable_versions, weights_dir

TEMPERATURE = 0.8


def trainer_config(model: Path, run_dir: Path, **overrides: object) -> RLTrainerConfig:
    base = {
        "model.name": str(model),
        "model.device": "cpu",
        "run_dir": str(run_dir),
        "max_steps": 1,
        "optim.lr": 1e-3,
        "rollout_timeout_s": 30,
        "logprob_chunk_size": 16,
    }
    return build_config(RLTrainerConfig, overrides=list({**base, **overrides}.items()))


def surrogate(model: torch.nn.Module, samples: list[Sample]) -> float:
    """Σ A · log π over completion tokens: what a policy-gradient step should increase."""
    (micro_batches,) = pack_samples(samples, seq_len=128, num_ranks=1, micro_batch_tokens=1 << 14)
    total = 0.0
    with torch.no_grad():
        for mb in micro_batches:
            lp, _ = sequence_logprobs(model, mb.input_ids, mb.position_ids, TEMPERATURE)
            total += float((lp * mb.advantages)[mb.loss_mask].sum())
    return total


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.mark.parametrize("master_weights", ["model", "optimizer"])
def test_step0_matches_sampler_and_update_follows_advantages(
    model_dir: Path, tmp_path: Path, master_weights: str
) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(model_dir))
    samples = sample_reverse_text(base, tokenizer, 4, 4, TEMPERATURE, 24, seed=0)
    assert any(s.advantage != 0 for s in samples)
    write_rollouts(tmp_path, 0, samples, TEMPERATURE)

    result = train(trainer_config(model_dir, tmp_path, **{"optim.master_weights": master_weights}))

    # before the update the trainer's logprobs are the sampler's: fp32 CPU, same weights
    assert result["mismatch_kl"] <= 1e-6
    assert result["max_abs_logprob_diff"] <= 1e-4
    assert result["masked_fraction"] == 0
    assert result["loss_tokens"] == sum(len(s.completion_ids) for s in samples)
    assert result["staleness"] == 0 and result["samples"] == 16
    (record,) = read_metrics(tmp_path / "metrics.jsonl", "trainer")
    assert record["step"] == 0 and record["policy_version"] == 1 and record["grad_norm"] > 0

    out = weights_dir(tmp_path, 1)
    assert json.loads((out / STABLE).read_text()) == {"version": 1}
    assert stable_versions(tmp_path) == [1]
    updated = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert load_tokenizer(str(out)).get_vocab() == tokenizer.get_vocab()
    assert surrogate(updated, samples) > surrogate(base, samples)


def test_compute_dtype_sets_the_steps_precision(model_dir: Path, tmp_path: Path) -> None:
    """compute_dtype = bfloat16 over fp32 weights: the step's logprobs carry bf16's rounding, which
    the fp32 step (the test above: ≤ 1e-4) does not; float32 is what it is on CPU anyway."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = sample_reverse_text(base, load_tokenizer(str(model_dir)), 2, 4, TEMPERATURE, 24, seed=1)
    results = {}
    for dtype in ("bfloat16", "float32"):
        write_rollouts(tmp_path / dtype, 0, samples, TEMPERATURE)
        results[dtype] = train(
            trainer_config(model_dir, tmp_path / dtype, compute_dtype=dtype, **{"model.dtype": "float32"})
        )
    assert results["bfloat16"]["max_abs_logprob_diff"] > 1e-3
    assert results["float32"]["max_abs_logprob_diff"] <= 1e-4


def test_later_step_waits_and_times_out_naming_the_path(model_dir: Path, tmp_path: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = sample_reverse_text(base, load_tokenizer(str(model_dir)), 2, 2, TEMPERATURE, 8, seed=1)
    write_rollouts(tmp_path, 0, samples, TEMPERATURE)
    with pytest.raises(TimeoutError, match=r"rollouts/step_1/READY"):
        train(trainer_config(model_dir, tmp_path, max_steps=2, rollout_timeout_s=1))
    assert stable_versions(tmp_path) == [1]


def test_token_ids_outside_the_vocabulary_are_reported(model_dir: Path, tmp_path: Path) -> None:
    sample = Sample([1, 5, 7], [600, 2], [True, True], [-1.0, -1.0], 1.0, 0.5, 0, task_id="bad")
    write_rollouts(tmp_path, 0, [sample], TEMPERATURE)
    with pytest.raises(
        RolloutError, match=r"token ids span \[1, 600\], outside the model's vocabulary of 512"
    ):
        train(trainer_config(model_dir, tmp_path))


def test_cli_reports_a_rollout_timeout_in_one_line(model_dir: Path, tmp_path: Path) -> None:
    argv = ["--model.name", str(model_dir), "--model.device", "cpu", "--run_dir", str(tmp_path)]
    argv += ["--rollout_timeout_s", "0.5"]
    done = subprocess.run(
        [sys.executable, "-m", "tandem.trainer.rl.cli", *argv], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"trainer: error: timed out after 0.5s waiting for {tmp_path}/rollouts/step_0/READY"
    )


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(
    model_dir: Path, tmp_path: Path
) -> None:
    """It trains the same steps again from the same rollouts, to the same weights; metrics.jsonl
    keeps both attempts and marks the second's records as repeats."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(model_dir))
    for step in range(2):
        write_rollouts(
            tmp_path, step, sample_reverse_text(base, tokenizer, 2, 2, TEMPERATURE, 8, seed=step), TEMPERATURE
        )
    cfg = trainer_config(model_dir, tmp_path, max_steps=2, **{"ckpt.interval": 5, "ckpt.final": False})
    first = train(cfg)
    first_weights = AutoModelForCausalLM.from_pretrained(weights_dir(tmp_path, 2)).state_dict()
    again = train(cfg.model_copy(update={"resume": True}))
    assert again["loss"] == first["loss"]
    for name, weight in AutoModelForCausalLM.from_pretrained(weights_dir(tmp_path, 2)).state_dict().items():
        torch.testing.assert_close(weight, first_weights[name], rtol=0, atol=0)
    records = read_metrics(tmp_path / "metrics.jsonl", "trainer")
    assert [(r["step"], r.get("repeated", False), r.get("attempt", 1)) for r in records] == [
        (0, False, 1),
        (1, False, 1),
        (0, True, 2),
        (1, True, 2),
    ]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "trainer", latest=True)] == [0, 1]


@pytest.mark.parametrize(
    ("overrides", "left"),
    [
        (
            {"ckpt.interval": 2, "ckpt.final": False},
            [3, 4],
        ),  # checkpoint 4 resumes at step 4: 3 (last trained before it) and 4 stay
        ({"ckpt.interval": 2}, [4]),  # the final checkpoint (5) resumes after step 4: only it stays
        ({"ckpt.interval": 0}, [4]),  # no resume possible: only the last trained step stays
        ({"ckpt.interval": 0, "prune_rollouts": False}, [0, 1, 2, 3, 4]),
    ],
)
def test_trained_rollouts_are_pruned_unless_a_resume_needs_them(
    model_dir: Path, tmp_path: Path, overrides: dict, left: list[int]
) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = sample_reverse_text(base, load_tokenizer(str(model_dir)), 2, 2, TEMPERATURE, 8, seed=2)
    for step in range(5):
        write_rollouts(tmp_path, step, samples, TEMPERATURE)
    train(trainer_config(model_dir, tmp_path, max_steps=5, **overrides))
    kept = sorted(int(p.name[5:]) for p in (tmp_path / "rollouts").glob("step_*"))
    assert kept == left
    final = bool(overrides["ckpt.interval"]) and overrides.get("ckpt.final", True)
    assert (tmp_path / "checkpoints" / "step_5").is_dir() == final  # (5 steps: not a multiple of 2)
    assert len(read_metrics(tmp_path / "metrics.jsonl", "trainer")) == 5
