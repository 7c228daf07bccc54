"""Load and save Hugging Face causal LMs (local directory or hub name)."""

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from tandem.cli import UserError
from tandem.config.base import ModelConfig
from tandem.models.source import model_source

hf_logging.disable_progress_bar()  # per-tensor loading bars drown tandem's own progress lines

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GENERATION_CONFIG = "generation_config.json"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("model.device is 'cuda' but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    source = model_source(name)
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise UserError(f"cannot load tokenizer '{name}': {str(e).splitlines()[0]}") from None


def load_model(cfg: ModelConfig, device: torch.device | None = None) -> PreTrainedModel:
    """Load `cfg.name` with the configured dtype and attention implementation onto `device`."""
    source = model_source(cfg.name)
    device = device or resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )
    except OSError as e:
        raise UserError(f"cannot load model '{cfg.name}': {str(e).splitlines()[0]}") from None
    return model.to(device)


def save_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save model (safetensors + config), tokenizer with chat template and generation config (the
    one of the checkpoint `model` was loaded from: save_tokenizer_files).

    `state_dict` lets a sharded trainer pass gathered full weights for an unsharded `model`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    save_tokenizer_files(tokenizer, out_dir, model.config.name_or_path)


def save_tokenizer_files(
    tokenizer: PreTrainedTokenizerBase, out_dir: Path, source: str | None = None
) -> None:
    """The tokenizer (with its chat template) and the generation config: the `source` model's
    generation_config.json copied as it is (its stop ids and sampling defaults: Qwen3's ends at
    two eos ids), or where it has none, a greedy one ending at the tokenizer's EOS."""
    tokenizer.save_pretrained(out_dir)
    found = generation_config_file(source) if source else None
    if found is not None:
        shutil.copyfile(found, Path(out_dir) / GENERATION_CONFIG)
        return
    generation = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    generation.save_pretrained(out_dir)


def generation_config_file(source: str) -> Path | None:
    """The generation_config.json of model `source` (a directory, or a hub name: from the cache,
    downloaded if need be); None when it has none or it cannot be had."""
    directory = Path(source).expanduser()
    if directory.is_dir():
        found = directory / GENERATION_CONFIG
        return found if found.is_file() else None
    from transformers.utils import cached_file

    try:
        found = cached_file(
            source,
            GENERATION_CONFIG,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except OSError:
        return None
    return None if found is None else Path(found)
