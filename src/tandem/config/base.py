"""Base class for every tandem config section: strict, typed, and written once."""

from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from tandem.models.registry import FAMILIES


class Section(BaseModel):
    """A config section. Unknown keys are errors; values are validated on assignment too; inf and
    nan are refused wherever a number is expected (no setting means "infinite"); an empty string
    is refused for a text or path key (unless "" is its default: unset).

    The loader validates what files and the command line give in pydantic's strict mode (a TOML
    value has its type: `max_steps = "10"` or `resume = 1` is an error, not 10 or true); a path is
    written as a string and a fixed-length list (AdamW's betas) as a list, which this section turns
    into the Path and tuple the strict mode wants. Sections built in code validate as usual."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def plain_values(cls, value: Any, info: ValidationInfo) -> Any:
        """What pydantic would read otherwise: true as 1 where a number is expected (a `--key`
        given no value is true), "" as the current directory. A path's string becomes a Path and
        a list for a tuple a tuple (a TOML file has neither type)."""
        if not info.field_name:
            return value
        field = cls.model_fields[info.field_name]
        types = member_types(field.annotation)
        if isinstance(value, bool) and takes_number(field.annotation):
            raise PydanticCustomError(
                "bool_for_number", "expects a number, not true/false (a --key given no value is true)"
            )
        if value == "" and isinstance(value, str) and (str in types or Path in types) and field.default != "":
            raise PydanticCustomError("empty", "is empty: give a value or leave the key out")
        if Path in types and not isinstance(value, str | Path | None):
            raise PydanticCustomError("path_type", "expects a path, written as a string")
        if isinstance(value, str) and Path in types:
            return Path(value)
        if isinstance(value, list) and any(get_origin(t) is tuple for t in types):
            return tuple(value)
        return value


def member_types(annotation: Any) -> list[Any]:
    """A field type's members: `int | None` → [int, NoneType]; anything else → [itself]."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return list(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else [annotation]


def takes_number(annotation: Any) -> bool:
    """Whether a field's type is a number and not a boolean (`int`, `float | None`, ...)."""
    types = member_types(annotation)
    return (int in types or float in types) and bool not in types


def base_urls(urls: list[str]) -> list[str]:
    """A field validator for server base URLs: each http(s)://host:port, not a bare address (which
    every request to it would fail on, after the run started)."""
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"'{url}' is not a base URL (http://host:port)")
    return urls


class ModelConfig(Section):
    """Which model to load and how."""

    name: str = Field("", description="Local directory or Hugging Face hub name of a causal LM.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype; auto = bfloat16 on GPU, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    impl: Literal["auto", "tandem", "hf"] = Field(
        "auto",
        description="Trainer model code: tandem's own implementation of the checkpoint's model type "
        f"({', '.join(FAMILIES)}), transformers' (hf), or auto = tandem's when the type has one.",
    )
    attention: Literal["auto", "flex", "varlen", "cudnn", "flash", "sdpa", "sdpa_docs"] = Field(
        "auto",
        description="Packed-sequence attention of tandem's models: auto = the fastest measured on CUDA, "
        "sdpa on CPU; cudnn needs the nvidia-cudnn-frontend package, flash the flash-attn-4 package "
        "(docs/trainer.md).",
    )
    head_logits: Literal["recompute", "keep"] = Field(
        "recompute",
        description="The trainer's output head: recompute each chunk's logits in the backward, or keep "
        "them from the forward (one of the head's four matmuls less: +5.7 % tok/s at 1.7B on an H200; costs "
        "tokens x vocabulary x 2 bytes, 5 GB for 16,384 tokens of a 152k vocabulary).",
    )
    sparse_attention: Literal["always", "long_documents"] = Field(
        "always",
        description="GLM-5 (DeepSeek sparse attention), trainer: always = run the indexers and attend to their "
        "chosen keys; long_documents = only in micro-batches with a document longer than index_topk (where "
        "none is, the indexers would choose every visible key, so skipping them and attending through the "
        "packed backend is exact). Not yet measured on a GPU.",
    )
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] = Field(
        "sdpa", description="Attention implementation transformers uses for this model (model.impl = hf)."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint's repository.")


CPStyle = Literal["ulysses", "ring"]
"""How context parallelism splits a packed row over its ranks (models/context_parallel.py)."""


def cp_width_multiple(cp: int, style: CPStyle) -> int:
    """What a packed row's width must be a multiple of under context parallelism: one chunk per
    rank (ulysses), or two per rank for the zigzag causal load balancing (ring)."""
    return cp if style == "ulysses" or cp == 1 else 2 * cp


SHARED_FIELDS = ("model", "seq_len", "max_steps", "run_dir", "seed", "monitor")
"""Fields written once at the top of a config file that flow into every sub-section declaring them."""
