"""Whether a model name can be loaded at all, checked without torch (the launcher's preflight)."""

import json
from pathlib import Path

from tandem.cli import UserError


def check_model_source(name: str) -> None:
    """Fail clearly on an empty name or a path-looking name that does not exist."""
    if not name:
        raise UserError("model.name is empty: give a local directory or a hub name")
    looks_local = name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1
    if looks_local and not (Path(name).expanduser() / "config.json").is_file():
        raise UserError(f"model path '{name}' does not exist or has no config.json")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, BPE vocab


def check_local_checkpoint(name: str, weights: bool = True) -> None:
    """A local model directory must hold a tokenizer and (`weights`) weights: without tokenizer_config.json
    transformers silently falls back to a default tokenizer class (another end-of-turn token:
    rewards computed on wrongly decoded text), and missing files failed only after the server
    started. A hub name is checked where it is downloaded."""
    directory = Path(name).expanduser()
    if not (directory / "config.json").is_file():
        return
    missing = []
    if not (directory / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    if weights and not any(directory.glob("*.safetensors")) and not any(directory.glob("*.bin")):
        missing.append("weights (*.safetensors)")
    if missing:
        raise UserError(f"model directory {name} lacks {'; '.join(missing)}")


EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")  # qwen3_moe; GLM; MiniMax


def check_expert_parallel(name: str, ep: int) -> None:
    """trainer.parallel.ep > 1 needs a mixture-of-experts checkpoint whose expert count it divides.
    Checked where `name` is a local directory; a hub name is checked by the trainer when it loads."""
    config_file = Path(name).expanduser() / "config.json"
    if ep == 1 or not config_file.is_file():
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    experts = next((config[k] for k in EXPERT_COUNT_KEYS if config.get(k)), None)
    if experts is None:
        raise UserError(
            f"trainer.parallel.ep = {ep}, but {config_file} ({config.get('model_type')}) has no experts to split"
        )
    if experts % ep:
        raise UserError(
            f"trainer.parallel.ep = {ep} does not divide the model's {experts} experts ({config_file})"
        )
