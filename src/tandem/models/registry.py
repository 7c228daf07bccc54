"""The model families tandem implements, keyed by Hugging Face `model_type`.

A family is a folder `models/<model_type>/` with three parts (the torchtitan layout):
`model.py` builds the plain-PyTorch model from a transformers config, `parallelize.py` applies
FSDP2, activation checkpointing, torch.compile and expert parallelism to it, and
`state_dict_adapter.py` maps its parameters to the checkpoint's tensor names and shapes.
Adding a family is adding such a folder and one line to `FAMILIES`.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tandem.models.hf_checkpoint import Layout
    from tandem.models.layers.transformer import CausalLM
    from tandem.models.parallelism import ParallelPlan

FAMILIES = ("qwen3", "qwen3_moe", "glm4_moe", "minimax_m2", "glm_moe_dsa")


class UnsupportedConfig(ValueError):
    """A checkpoint config field that tandem's implementation of the family does not support."""


@dataclass(frozen=True)
class Family:
    model_type: str
    build: "Callable[[PretrainedConfig, str], CausalLM]"  # (config, attention backend) → model
    hf_layout: "Callable[[PretrainedConfig], dict[str, Layout]]"  # tandem name → checkpoint layout
    parallelize: "Callable[[CausalLM, ParallelPlan], None]"
    # checkpoint tensors that are read by nothing, on purpose: names, or prefixes ending in "."
    hf_ignored: "Callable[[PretrainedConfig], tuple[str, ...]]" = lambda config: ()


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise KeyError(model_type)
    package = f"tandem.models.{model_type}"
    model = importlib.import_module(f"{package}.model")
    adapter = importlib.import_module(f"{package}.state_dict_adapter")
    parallel = importlib.import_module(f"{package}.parallelize")
    return Family(
        model_type,
        model.build,
        adapter.hf_layout,
        parallel.parallelize,
        _ignored(adapter),
    )


def _ignored(adapter: Any) -> "Callable[[PretrainedConfig], tuple[str, ...]]":
    """The adapter's `hf_ignored(config)`, or its constant `HF_IGNORED`."""
    if hasattr(adapter, "hf_ignored"):
        return adapter.hf_ignored
    names = getattr(adapter, "HF_IGNORED", ())
    return lambda config: names


def require(config: Any, field: str, allowed: Callable[[Any], bool], what: str) -> Any:
    """The config's `field`, or UnsupportedConfig naming the field and its value."""
    value = getattr(config, field, None)
    if not allowed(value):
        raise UnsupportedConfig(
            f"{config.model_type}: config field {field} = {value!r} is not supported by tandem's "
            f"implementation ({what})"
        )
    return value
