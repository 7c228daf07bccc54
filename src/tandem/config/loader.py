"""Load a typed config from TOML files and command-line overrides.

    sft @ base.toml @ local.toml --optim.lr 3e-4 --model.name ./my-model --dry-run

`@ FILE` (or `@FILE`) arguments are merged left to right, then each `--section.key value`
override is applied. Keys may be written in kebab-case or snake_case. Values on the command
line are read as TOML values when they parse as one (`3e-4`, `true`, `[1, 2]`) and as plain
strings otherwise. A flag with no value (`--resume`) means `true` (an error for a number key).

Shared fields (see `SHARED_FIELDS`) set at the top level are copied into every sub-section that
declares a field of the same name, unless that sub-section sets its own value.
"""

import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, Tag, ValidationError

from tandem.config.base import SHARED_FIELDS
from tandem.config.fields import is_optional, walk_keys

C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """A config problem a user can fix; its message is one line naming the key or file."""


def normalise_keys(data: Any, prefix: str = "") -> Any:
    """kebab-case keys → snake_case, recursively; a key written both ways is an error (TOML
    refuses a key written twice, but sees two keys here)."""
    if isinstance(data, dict):
        normalised: dict[str, Any] = {}
        for key, value in data.items():
            snake = str(key).replace("-", "_")
            if snake in normalised:
                raise ConfigError(f"key '{prefix}{snake}' is written twice: in kebab-case and in snake_case")
            normalised[snake] = normalise_keys(value, f"{prefix}{snake}.")
        return normalised
    if isinstance(data, list):
        return [normalise_keys(v, prefix) for v in data]
    return data


def deep_merge(base: dict, update: dict) -> dict:
    """Merge `update` into a copy of `base`; tables merge key by key, everything else replaces."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_toml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give a .toml file in it")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"malformed TOML in {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
        ) from None
    try:
        return normalise_keys(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.replace("-", "_").split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def split_args(argv: Sequence[str]) -> tuple[list[Path], list[tuple[str, Any]], dict[str, bool]]:
    """Split argv into config files, `--key value` overrides and the loader's own flags."""
    files: list[Path] = []
    overrides: list[tuple[str, Any]] = []
    flags = {"dry_run": False, "help": False}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' must be followed by a config file path")
            files.append(Path(args[i + 1]))
            i += 2
            continue
        if arg.startswith("@"):
            files.append(Path(arg[1:]))
        elif arg in ("--dry-run", "--dry_run"):
            flags["dry_run"] = True
        elif arg in ("-h", "--help"):
            flags["help"] = True
        elif arg.startswith("--"):
            key, eq, inline = arg[2:].partition("=")
            if not key:
                raise ConfigError(f"malformed argument '{arg}'")
            if eq:
                overrides.append((key, parse_value(inline)))
            elif i + 1 < len(args) and not args[i + 1].startswith("--") and not args[i + 1].startswith("@"):
                overrides.append((key, parse_value(args[i + 1])))
                i += 1
            else:
                overrides.append((key, True))
        else:
            raise ConfigError(f"unexpected argument '{arg}' (use '@ FILE' or '--section.key value')")
        i += 1
    return files, overrides, flags


def spread_shared_fields(cls: type[BaseModel], data: dict) -> dict:
    """Copy top-level shared fields into sub-sections that declare them and leave them unset."""
    data = dict(data)
    for name, field in cls.model_fields.items():
        sub_cls = field.annotation
        if not (isinstance(sub_cls, type) and issubclass(sub_cls, BaseModel)):
            continue
        default = field.get_default(call_default_factory=True)
        # A section default written as an instance (`optim: Optim = Optim(lr=1e-5)`) keeps the
        # values it sets; the file's keys are merged over them.
        base = default.model_dump(exclude_unset=True) if isinstance(default, BaseModel) else {}
        section = data.get(name, {})
        if not isinstance(section, dict):
            continue
        section = deep_merge(base, section)
        for shared in SHARED_FIELDS:
            if shared not in data or shared not in sub_cls.model_fields:
                continue
            value, own = data[shared], section.get(shared)
            if isinstance(value, dict) and isinstance(own, dict):
                section[shared] = deep_merge(value, own)
            elif shared not in section:
                section[shared] = value
        data[name] = spread_shared_fields(sub_cls, section)
    return data


def _unwrap(annotation: Any) -> Any:
    """`Annotated[X, ...]` and `X | None` → X; a union of several types stays as it is."""
    while True:
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        elif get_origin(annotation) in (Union, UnionType):
            rest = [a for a in get_args(annotation) if a is not type(None)]
            if len(rest) > 1:
                return annotation
            annotation = rest[0]
        else:
            return annotation


def _union_member(annotation: Any, label: int | str) -> Any:
    """The member of a tagged union that `label` tags (None if untagged or not a union)."""
    for member in get_args(annotation):
        tags = (
            [m.tag for m in get_args(member)[1:] if isinstance(m, Tag)]
            if get_origin(member) is Annotated
            else []
        )
        if label in tags:
            return member
    return None


def key_path(cls: type[BaseModel] | None, loc: tuple[int | str, ...]) -> str:
    """The dotted key an error's location names. Pydantic adds the union member it tried
    (`trainer.loss.ppo_clip.clip`, `lora.target_modules.str`): no key the user wrote."""
    keys: list[str] = []
    node: Any = cls
    for part in loc:
        node = _unwrap(node)
        if get_origin(node) in (Union, UnionType):
            node = _union_member(node, part)
            continue
        fields = node.model_fields if isinstance(node, type) and issubclass(node, BaseModel) else {}
        node = fields[part].annotation if part in fields else None
        keys.append(str(part))
    return ".".join(keys) or "<root>"


def format_validation_error(error: ValidationError, cls: type[BaseModel] | None = None) -> str:
    """All of `error`'s problems in one line, keys named as written (given `cls`, the validated
    model). A shared field's problem is named once, not again for each section it flowed into."""
    problems: dict[tuple[str, str], str] = {}  # (key, what is wrong) → the text naming both
    for item in error.errors():
        key = key_path(cls, item["loc"])
        if item["type"] == "extra_forbidden":
            what, text = "unknown", f"unknown key '{key}'"
        elif item["type"] == "missing":
            what, text = "missing", f"missing required key '{key}'"
        else:
            given = item.get("input")
            what = item["msg"] + (f" (got {given!r})" if not isinstance(given, dict | list) else "")
            text = f"'{key}': {what}" if item["loc"] else what  # (a whole-config check names its keys)
        problems.setdefault((key, what), text)
    shared = [(key, what) for key, what in problems if key.split(".")[0] in SHARED_FIELDS]
    texts = [
        text
        for (key, what), text in problems.items()
        if not any(key.endswith(f".{top}") and what == same for top, same in shared)
    ]
    return "invalid config: " + "; ".join(texts)


def build_config(cls: type[C], files: Sequence[Path] = (), overrides: Sequence[tuple[str, Any]] = ()) -> C:
    data: dict = {}
    for path in files:
        data = deep_merge(data, read_toml(path))
    for key, value in overrides:
        set_path(data, key, value)
    data = spread_shared_fields(cls, data)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, cls)) from None


def to_toml(config: BaseModel) -> str:
    """The resolved config as TOML (None values are left out, since TOML has no null)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


def describe_fields(cls: type[BaseModel]) -> list[str]:
    """`--help`'s lines: every key (tandem.config.fields), a section only when it says something."""
    lines = []
    for key in walk_keys(cls):
        doc = f"  {key.description}" if key.description else ""
        if key.section:
            if doc or is_optional(key.annotation):
                lines.append(f"  [{key.path}]{' (optional)' if is_optional(key.annotation) else ''}{doc}")
            continue
        notes = [", ".join(key.types)] if key.types else []
        notes.append("required" if key.required else f"default {key.default!r}")
        lines.append(f"  --{key.path} ({'; '.join(notes)}){doc}")
    return lines


def parse_config(cls: type[C], argv: Sequence[str] | None = None, prog: str = "tandem") -> C:
    """Parse argv into `cls`; handles `--help` and `--dry-run` (print TOML and exit 0)."""
    files, overrides, flags = split_args(sys.argv[1:] if argv is None else argv)
    if flags["help"]:
        print(f"usage: {prog} [@ CONFIG.toml ...] [--section.key VALUE ...] [--dry-run]\n\nfields:")
        print("\n".join(describe_fields(cls)))
        raise SystemExit(0)
    config = build_config(cls, files, overrides)
    if flags["dry_run"]:
        print(to_toml(config), end="")
        raise SystemExit(0)
    return config
