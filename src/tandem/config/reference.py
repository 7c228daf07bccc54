"""Render config classes as Markdown field tables, so the reference in docs/ never drifts.

    uv run python -m tandem.config.reference > docs/config-reference.md

A test regenerates this text and compares it with the committed file.
"""

import importlib
import json
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

# (title, command, "module:Class") of every config that has a console script.
DOCUMENTED = [
    ("SFT trainer", "sft", "tandem.trainer.sft.config:SFTConfig"),
    ("Evaluation", "evaluate", "tandem.evaluate:EvalConfig"),
    ("Tiny-model builder", "tiny-model", "tandem.models.tiny:TinyModelConfig"),
    ("Inference server", "inference", "tandem.inference.config:InferenceConfig"),
    ("Orchestrator", "orchestrator", "tandem.orchestrator.config:OrchestratorConfig"),
    ("RL trainer", "trainer", "tandem.trainer.rl.config:RLTrainerConfig"),
    ("RL launcher", "rl", "tandem.launch.config:RLConfig"),
]


def type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Annotated:
        return type_name(get_args(annotation)[0])
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, UnionType):
        return " \\| ".join(type_name(a) for a in get_args(annotation) if a is not type(None)) + " (optional)"
    if origin is not None:
        args = ", ".join(type_name(a) for a in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    if isinstance(value, BaseModel):
        return ""
    return "`" + json.dumps(value, default=str) + "`"


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The config class of a section field (`X` or an optional `X | None`), else None."""
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def section_rows(cls: type[BaseModel], prefix: str = "") -> list[str]:
    rows, nested = [], []
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        if (section := section_class(annotation)) is not None:
            nested.append((f"{prefix}{name}.", section))
            continue
        doc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name}` | {type_name(annotation)} | {default_text(field)} | {doc} |")
    for sub_prefix, sub_cls in nested:
        rows.extend(section_rows(sub_cls, sub_prefix))
    return rows


def render_reference() -> str:
    parts = [
        "# Config reference",
        "",
        "Generated from the config classes by `uv run python -m tandem.config.reference`; do not edit by hand.",
        "Every key can be set in a TOML file (`[section]` tables) or on the command line (`--section.key value`).",
    ]
    for title, command, target in DOCUMENTED:
        module_name, class_name = target.split(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        parts += [
            "",
            f"## {title} (`{command}`)",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        parts += section_rows(cls)
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
