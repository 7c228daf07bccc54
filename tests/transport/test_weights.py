"""Publishing weights/step_N: complete HF models with STABLE last, pruning, waiting."""

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.models.loading import load_tokenizer
from tandem.models.tiny import build_tiny_model
from tandem.trainer.parallel import World
from tandem.transport.weights import (
    STABLE,
    latest_version,
    publish_weights,
    stable_versions,
    wait_for_version,
    weights_dir,
)

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("w") / "tiny"
    return build_tiny_model(out=out, num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64)


def test_publish_prune_and_republish(model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(model_dir))
    assert latest_version(tmp_path) is None
    for version in range(1, 5):
        with torch.no_grad():
            model.model.norm.weight.fill_(float(version))
        publish_weights(model, tokenizer, tmp_path, version, WORLD, keep=2)
    assert stable_versions(tmp_path) == [3, 4] and latest_version(tmp_path) == 4
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_3", "step_4"]
    assert json.loads((weights_dir(tmp_path, 4) / STABLE).read_text()) == {"version": 4}

    loaded = AutoModelForCausalLM.from_pretrained(weights_dir(tmp_path, 3), dtype=torch.float32)
    assert torch.all(loaded.model.norm.weight == 3.0)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)

    with torch.no_grad():
        model.model.norm.weight.fill_(7.0)
    publish_weights(model, tokenizer, tmp_path, 4, WORLD, keep=2)  # a resumed run publishes again
    again = AutoModelForCausalLM.from_pretrained(weights_dir(tmp_path, 4), dtype=torch.float32)
    assert torch.all(again.model.norm.weight == 7.0) and stable_versions(tmp_path) == [3, 4]
    assert not [p for p in (tmp_path / "weights").iterdir() if p.name.startswith(".")]


def test_wait_for_version(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match=r"0\.2s waiting for .*weights/step_1/STABLE"):
        wait_for_version(tmp_path, 1, timeout_s=0.2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(model_dir))
    writer = threading.Timer(0.2, publish_weights, args=(model, tokenizer, tmp_path, 1, WORLD))
    writer.start()
    assert wait_for_version(tmp_path, 1, timeout_s=30) == weights_dir(tmp_path, 1)
    writer.join()
