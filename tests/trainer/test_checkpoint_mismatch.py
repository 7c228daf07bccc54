"""A resume whose model no longer matches its checkpoint (another model, LoRA switched on or off,
another rank) fails in one line naming the checkpoint and the first tensor that differs, before
torch.distributed.checkpoint reads anything (it fails with a traceback per rank). Under LoRA a base
of the same shapes with other weights is refused too (the checkpoint holds only the adapters)."""

import shutil
from pathlib import Path

import pytest
import torch

from tandem.cli import UserError
from tandem.config.base import ModelConfig
from tandem.models.tiny import build_tiny_model
from tandem.trainer.checkpoint import SHARDS, TRAINER_STATE, load_checkpoint, save_checkpoint
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


def test_lora_adapters_resumed_on_another_base_of_the_same_shapes_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two tiny models that differ only in their seed: the same config.json, file names, sizes and
    tensor shapes, so check_fits passes; the adapters were trained on the first."""
    one = build_tiny_model(out=tmp_path / "one", num_layers=1)
    other = build_tiny_model(out=tmp_path / "other", num_layers=1, seed=1)
    assert (one / "config.json").read_bytes() == (other / "config.json").read_bytes()
    assert (one / "model.safetensors").stat().st_size == (other / "model.safetensors").stat().st_size
    moved = Path(shutil.copytree(one, tmp_path / "moved"))
    path = save_checkpoint(tmp_path / "ckpt", 3, *trainer(one, LORA))
    bare = Path(
        shutil.copytree(path, tmp_path / "bare")
    )  # the shards' data gone: refused before reading them
    for data in (bare / SHARDS).glob("*.distcp"):
        data.unlink()
    refused = (
        rf"cannot resume from {bare}: its LoRA adapters were trained on base model {one} \(fingerprint "
        rf"[0-9a-f]{{12}}\), the run's model.name is {other} \(fingerprint [0-9a-f]{{12}}\); set model.name back"
    )
    with pytest.raises(UserError, match=refused) as error:
        load_checkpoint(bare, *trainer(other, LORA))
    assert "\n" not in str(error.value)

    assert load_checkpoint(path, *trainer(moved, LORA))[0] == 3  # the same files elsewhere: resumes
    assert f"the base model was {one} when {path} was written, now {moved}" in capsys.readouterr().out
    shutil.copytree(other, one, dirs_exist_ok=True)  # the same name now holds other weights
    with pytest.raises(UserError, match=r"the same name, other weights or config"):
        load_checkpoint(path, *trainer(one, LORA))

    state = torch.load(path / TRAINER_STATE, weights_only=False)  # as an older tandem wrote it
    del state["base_model"]
    torch.save(state, path / TRAINER_STATE)
    capsys.readouterr()
    assert load_checkpoint(path, *trainer(other, LORA))[0] == 3
    assert capsys.readouterr().out.count("does not record which base model") == 1


def test_full_fine_tuning_resumes_its_own_weights_whatever_the_base(tmp_path: Path) -> None:
    """Without LoRA the checkpoint holds every weight: another base of the same shapes changes none."""
    one = build_tiny_model(out=tmp_path / "one", num_layers=1)
    other = build_tiny_model(out=tmp_path / "other", num_layers=1, seed=1)
    saved, *rest = trainer(one, None)
    path = save_checkpoint(tmp_path / "ckpt", 1, saved, *rest)
    resumed, *rest = trainer(other, None)
    assert load_checkpoint(path, resumed, *rest)[0] == 1
    for (name, a), (_, b) in zip(saved.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
