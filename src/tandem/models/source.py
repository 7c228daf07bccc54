"""Whether a model name can be loaded at all, checked without torch (the launcher's preflight)."""

from pathlib import Path

from tandem.cli import UserError


def check_model_source(name: str) -> None:
    """Fail clearly on an empty name or a path-looking name that does not exist."""
    if not name:
        raise UserError("model.name is empty: give a local directory or a hub name")
    looks_local = name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1
    if looks_local and not (Path(name).expanduser() / "config.json").is_file():
        raise UserError(f"model path '{name}' does not exist or has no config.json")
