"""A resume whose model no longer matches its checkpoint (another model, LoRA switched on or off,
another rank) fails in one line naming the checkpoint and the first tensor that differs, before
torch.distributed.checkpoint reads anything (it fails with a traceback per rank)."""

from pathlib import Path

import pytest
import torch

from tandem.cli import UserError
from tandem.config.base import ModelConfig
from tandem.models.tiny import build_tiny_model
from tandem.trainer.checkpoint import SHARDS, load_checkpoint, save_checkpoint
from tandem.trainer.config import LoRAConfig, OptimConfig, ParallelConfig
from tandem.trainer.model import build_trainer_model
from tandem.trainer.optim import build_optimizer
from tandem.trainer.parallel import init_distributed

LORA = LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj"])


def trainer(model: Path, lora: LoRAConfig | None) -> tuple:
    world = init_distributed("cpu")
    net = build_trainer_model(ModelConfig(name=str(model), device="cpu"), world, ParallelConfig(), lora=lora)
    optimizer = build_optimizer(net, OptimConfig(lr=1e-3))
    return net, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), world


def test_a_model_that_no_longer_fits_fails_in_one_line(tmp_path: Path) -> None:
    one = build_tiny_model(out=tmp_path / "one", num_layers=1)
    two = build_tiny_model(out=tmp_path / "two", num_layers=2)
    path = save_checkpoint(tmp_path / "ckpt", 3, *trainer(one, LORA))
    assert load_checkpoint(path, *trainer(one, LORA))[0] == 3  # the same settings resume
    cases = [
        (one, LoRAConfig(rank=4, alpha=4.0, target_modules=["q_proj"]),
         r"model.layers.0.attention.wqkv.lora_a is \[2, \d+\] in the checkpoint, \[4, \d+\] in the model"),
        (one, None, "the checkpoint has no model.embed.weight"),
        (two, LORA, "the checkpoint has no model.layers.1.attention.wqkv.lora_a"),
        (one, LoRAConfig(rank=2, alpha=4.0, target_modules=["v_proj"]), r"model.layers.0.attention.wqkv.lora_b is \[256, 2\] in the checkpoint, \[128, 2\] in the model"),
    ]  # fmt: skip
    for model, lora, message in cases:
        with pytest.raises(UserError, match=f"cannot resume from {path}: {message}") as error:
            load_checkpoint(path, *trainer(model, lora))
        assert "\n" not in str(error.value)
    other_alpha = LoRAConfig(rank=2, alpha=8.0, target_modules=["q_proj"])  # (same shapes, another scale)
    with pytest.raises(
        UserError, match=f"cannot resume from {path}: it was trained with lora.alpha = 4, the run sets 8"
    ):
        load_checkpoint(path, *trainer(one, other_alpha))
    full = save_checkpoint(tmp_path / "full", 1, *trainer(one, None))
    with pytest.raises(UserError, match=f"cannot resume from {full}: the checkpoint has no .*lora_a"):
        load_checkpoint(full, *trainer(one, LORA))
    (full / SHARDS / ".metadata").unlink()
    with pytest.raises(UserError, match=f"cannot resume from {full}: {full / SHARDS} cannot be read"):
        load_checkpoint(full, *trainer(one, None))
