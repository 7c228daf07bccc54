"""Context parallelism on gloo ranks gives the losses and gradients of the same step without it.

One launch of 4 gloo ranks (forked after one import of torch) runs every case of cp_worker.py on packed rows whose documents
cross the shard boundaries: tiny Qwen3 with cp = 2 and 4, Ulysses (4 ranks: KV heads replicated)
and ring (zigzag; with both CPU attention backends), with selective activation checkpointing;
the RL trainer's loss (masked_is per token, GSPO per sample); tiny Qwen3-MoE with cp = 2 and ep = 2 on the same 4 ranks (with full
checkpointing); tiny GLM-5 (latent attention gathered in both styles, the indexer's choice of 4
keys per query shared by a later layer, dense and sparse attention, ep = 2, the RL loss). Each case matches its cp = 1 case: the loss within 1e-5, every gradient within
1e-5 of that tensor's largest entry (the tied embedding's gradient reaches ~70 here, where fp32
sums in another order differ by ~1e-5 absolute; measured differences are below 5e-7 relative).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cp_worker import CASES, WIDTH
from process_output import failure
from transformers import AutoModelForCausalLM

from tandem.cli import UserError
from tandem.config.base import ModelConfig, cp_width_multiple
from tandem.models.context_parallel import check_heads
from tandem.models.loading import save_model
from tandem.models.tiny import TinyShape, build_tiny_model, tiny_config
from tandem.models.tokenizer import train_tokenizer
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.config import ParallelConfig
from tandem.trainer.model import build_trainer_model
from tandem.trainer.parallel import init_distributed
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.train import check_micro_batches
from tandem.transport.rollouts import Sample, pack_samples

WORKER = Path(__file__).parent / "cp_worker.py"
SMALL = {"num_layers": 2, "hidden_size": 64, "head_dim": 16, "intermediate_size": 128}  # 4 heads, 2 KV


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("cp")
    dense = build_tiny_model(out=root / "dense", **SMALL)
    moe = build_tiny_model(out=root / "moe", num_experts=4, moe_intermediate_size=32, **SMALL)
    return dense, moe, tiny_glm5(root / "glm5")


def tiny_glm5(out: Path) -> Path:
    """GLM-5 with 4 keys per query chosen by layers 0 and 2's indexers (layer 1 shares layer 0's)."""
    tokenizer = train_tokenizer()
    shape = TinyShape(family="glm_moe_dsa", num_experts=4, moe_intermediate_size=32, index_topk=4, **SMALL)
    config = tiny_config(
        shape.model_copy(update={"num_layers": 3}),
        len(tokenizer),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    config.indexer_types = ["full", "shared", "full"]
    torch.manual_seed(0)
    save_model(AutoModelForCausalLM.from_config(config), tokenizer, out)
    return out


@pytest.fixture(scope="module")
def results(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("cp-out") / "results.pt"
    done = subprocess.run(
        [sys.executable, WORKER, "4", *models, out],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert done.returncode == 0, failure(done)
    return torch.load(out)


@pytest.mark.parametrize("case", [name for name in CASES if "-" in name])
def test_cp_matches_cp1(results: dict, case: str) -> None:
    reference = results[case.split("-")[0]]
    got = results[case]
    parallel = ParallelConfig(**CASES[case][2])
    multiple = cp_width_multiple(parallel.cp, parallel.cp_style)
    assert got["shard_width"] == -(-WIDTH // multiple) * multiple // parallel.cp  # 1/cp of the padded row
    assert got["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    assert got["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        difference = float((got["grads"][name] - grad).abs().max())
        assert difference <= 1e-5 * scale, f"{name}: {difference:.3g} off at scale {scale:.3g}"
    if "stats" in reference:  # the RL trainer's step logs the same, counting each sample once
        assert got["stats"] == pytest.approx(reference["stats"], rel=1e-5)
        assert reference["stats"]["samples"] == 10 and reference["stats"]["loss_tokens"] > 0


def test_bad_parallel_settings_fail_at_start_in_one_line(models: tuple[Path, Path]) -> None:
    world = init_distributed("cpu")
    with pytest.raises(UserError, match=r"^trainer.parallel.cp = 2 does not divide the world size 1$"):
        build_trainer_model(ModelConfig(name=str(models[0]), device="cpu"), world, ParallelConfig(cp=2))
    with pytest.raises(ValueError, match="needs the 14 query heads to be a multiple of cp"):
        check_heads(14, 2, 4, "ulysses")
    with pytest.raises(ValueError, match="needs the 3 KV heads to be a multiple or a divisor of cp"):
        check_heads(6, 3, 2, "ulysses")
    check_heads(14, 2, 4, "ring")  # ring splits any head counts
    check_heads(16, 2, 8, "ulysses")  # fewer KV heads than cp: replicated
    with pytest.raises(ValueError, match="activation_offload works with activation_checkpointing = 'none'"):
        ParallelConfig(activation_offload=True, activation_checkpointing="selective")
    ParallelConfig(activation_offload=True, activation_checkpointing="full")  # offloads each block's input
    with pytest.raises(UserError, match=r"^trainer.parallel.activation_offload needs a CUDA device: on cpu"):
        build_trainer_model(
            ModelConfig(name=str(models[0]), device="cpu"), world, ParallelConfig(activation_offload=True)
        )
    with pytest.raises(ValueError, match=r"cp \(2\) must divide num_ranks \(3\)"):
        OrchestratorConfig(num_ranks=3, cp=2)


def test_rl_trainer_refuses_rows_longer_than_seq_len() -> None:
    sample = Sample([1, 2, 3], [4] * 27, [True] * 27, [-1.0] * 27, 1.0, 0.5, 0)
    (micro_batches,) = pack_samples([sample], 30, 1, 60, width_multiple=4)
    assert micro_batches[0].input_ids.shape[1] == 32  # padded for ring cp = 2
    ring = ParallelConfig(cp=2, cp_style="ring")
    check_micro_batches(micro_batches, 512, RLTrainerConfig(seq_len=30, parallel=ring), step=3)
    with pytest.raises(
        RuntimeError, match=r"rollouts/step_3: a micro-batch is 32 tokens wide, longer than seq_len 28"
    ):
        check_micro_batches(micro_batches, 512, RLTrainerConfig(seq_len=28), step=3)
