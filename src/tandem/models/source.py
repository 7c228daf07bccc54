"""Whether a model name can be loaded at all, checked without torch (the launcher's preflight)."""

import json
from pathlib import Path

from tandem.cli import UserError


def is_local_path(name: str) -> bool:
    """Whether `name` means a local directory rather than a hub repo id ("org/name"): it starts
    with ".", "/" or "~", has more than one "/", or its first component is a local directory."""
    first = name.split("/", 1)[0]
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(first).is_dir()


def check_model_source(name: str) -> None:
    """Fail at once on an empty name or a local path (is_local_path) that is not a model directory;
    a hub name is checked by check_hub_model."""
    if not name:
        raise UserError("model.name is empty: give a local directory or a hub name")
    if not is_local_path(name):
        return
    directory = Path(name).expanduser()
    if not directory.is_dir():
        first = name.split("/", 1)[0]
        shadow = ""
        if name.count("/") == 1 and not name.startswith((".", "/", "~")):  # an "org/name" under ./org
            shadow = f" (read as a local path: ./{first} is a directory here)"
        raise UserError(f"model.name = '{name}': no such directory{shadow}")
    if not (directory / "config.json").is_file():
        raise UserError(f"model.name = '{name}': the directory has no config.json")


def check_hub_model(name: str) -> None:
    """A hub name must be in the Hugging Face cache or on a hub that answers: checked with one
    request, as huggingface_hub retries an uncached file for about a minute before it gives up.
    Nothing to check for a local path (check_model_source)."""
    if not name or is_local_path(name):
        return
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    neither = f"model.name = '{name}' is neither a local directory nor"
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except HFValidationError:
        raise UserError(f"{neither} a valid hub name (org/name)") from None
    if constants.is_offline_mode():
        raise UserError(f"{neither} a model in the Hugging Face cache (HF_HUB_OFFLINE is set)")
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except GatedRepoError:
        raise UserError(
            f"model.name = '{name}' is a gated hub model: accept its terms on the hub and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{neither} a hub model on {constants.ENDPOINT} (or one that needs a login: hf auth login)"
        ) from None
    except RemoteEntryNotFoundError:
        raise UserError(f"model.name = '{name}': the hub model has no config.json") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise UserError(
            f"{neither} a reachable hub model ({constants.ENDPOINT} answered HTTP {status})"
        ) from None
    except Exception as e:  # no network, DNS, proxy, timeout (httpx's errors)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"{neither} a reachable hub model ({constants.ENDPOINT} cannot be reached: {reason})"
        ) from None


def model_source(name: str) -> str:
    """What from_pretrained is given for model.name, once both checks pass: the local directory
    (with ~ expanded) or the hub name."""
    check_model_source(name)
    check_hub_model(name)
    return str(Path(name).expanduser()) if is_local_path(name) else name


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
