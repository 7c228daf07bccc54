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
