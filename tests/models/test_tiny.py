"""Tiny-model builder and Hugging Face round trip."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.cli import UserError
from tandem.config import ModelConfig
from tandem.models.loading import load_model, load_tokenizer, save_model
from tandem.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(out=tmp_path_factory.mktemp("tiny") / "m")


def test_default_size_is_3_to_5m_parameters(tiny: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny)
    n = sum(p.numel() for p in model.parameters())
    assert 3e6 <= n <= 5e6


def test_saved_directory_has_hf_files(tiny: Path) -> None:
    for name in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"]:
        assert (tiny / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reverse the following text: abc"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|im_start|>user\nReverse the following text: abc<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_is_character_level_for_letters_and_round_trips(tiny: Path) -> None:
    tokenizer = load_tokenizer(str(tiny))
    ids = tokenizer("qwertyzx", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8
    text = "Héllo, wörld! 123 \t{}"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_build_save_reload_gives_identical_logits(tiny: Path, tmp_path: Path) -> None:
    model = load_model(ModelConfig(name=str(tiny), device="cpu"))
    tokenizer = load_tokenizer(str(tiny))
    save_model(model, tokenizer, tmp_path / "copy")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    ids = torch.randint(0, len(tokenizer), (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    small = dict(num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64)
    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(out=tmp_path / "a", seed=1, **small))
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(out=tmp_path / "b", seed=1, **small))
    c = AutoModelForCausalLM.from_pretrained(build_tiny_model(out=tmp_path / "c", seed=2, **small))
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_missing_model_path_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such directory"):
        load_model(ModelConfig(name=str(tmp_path / "nope")))
    with pytest.raises(UserError, match="empty"):
        load_model(ModelConfig(name=""))
