"""Render config classes as Markdown field tables, so the reference in docs/ never drifts.

    uv run python -m tandem.config.reference > docs/config-reference.md

A test regenerates this text and compares it with the committed file.
"""

import importlib
import json
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from tandem.config.fields import Key, is_optional, walk_keys

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
        names = " \\| ".join(type_name(a) for a in get_args(annotation) if a is not type(None))
        return names + (" (optional)" if is_optional(annotation) else "")
    if origin is not None:
        args = ", ".join(type_name(a) for a in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(key: Key) -> str:
    if key.required:
        return "required"
    if isinstance(key.default, BaseModel):
        return ""
    return "`" + json.dumps(key.default, default=str) + "`"


def section_rows(cls: type[BaseModel]) -> list[str]:
    """A row for every key; for a section only when it is optional or has a description."""
    rows = []
    for key in walk_keys(cls):
        if key.section and not (key.description or is_optional(key.annotation)):
            continue
        doc = (f"({', '.join(key.types)}) " if key.types else "") + key.description
        doc = doc.replace("|", "\\|").replace("\n", " ").strip()
        rows.append(f"| `{key.path}` | {type_name(key.annotation)} | {default_text(key)} | {doc} |")
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
