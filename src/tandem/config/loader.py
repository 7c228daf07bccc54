"""Load a typed config from TOML files and command-line overrides.

    sft @ base.toml @ local.toml --optim.lr 3e-4 --model.name ./my-model --dry-run

`@ FILE` (or `@FILE`) arguments are merged left to right, then each `--section.key value`
override is applied (a key given twice: the last one wins). Keys may be written in kebab-case or
snake_case. A value on the command line is text, read as its key's type: as a TOML value when
that is one the key takes (`3e-4`, `true`, `[1, 2]`), else as the key's type reads text (`.5` for
a number, `no` for a boolean, `32` or `04:00:00` for a text key), else as it stands (then the
error names it). A flag with no value (`--resume`) means `true` (an error for a number key).

A file's values have their TOML types, and are checked strictly: `max_steps = "10"`, `resume = 1`
or `batch_size = 8.0` is an error naming the key and the file, never read as 10, true or 8.

Shared fields (see `SHARED_FIELDS`) set at the top level are copied into every sub-section that
declares a field of the same name, unless that sub-section sets its own value.
"""

import difflib
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, Tag, TypeAdapter, ValidationError

from tandem.config.base import SHARED_FIELDS
from tandem.config.fields import is_optional, union_tag_field, walk_keys

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


class CliText(str):
    """A value as written on the command line, to be read as its key's type (`cli_value`)."""


def parse_value(text: str) -> Any:
    """`text` as a TOML value, else as CliText (which build_config reads as its key's type)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return CliText(text)


def set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.replace("-", "_").split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def split_args(
    argv: Sequence[str], raw: bool = False
) -> tuple[list[Path], list[tuple[str, Any]], dict[str, bool]]:
    """Split argv into config files, `--key value` overrides and the loader's own flags. A value
    is read as TOML where it is TOML (`parse_value`); with `raw` (parse_config) every value is
    kept as CliText, for build_config to read as its key's type (`cli_value`)."""
    read = CliText if raw else parse_value
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
                overrides.append((key, read(inline)))
            elif i + 1 < len(args) and not args[i + 1].startswith("--") and not args[i + 1].startswith("@"):
                overrides.append((key, read(args[i + 1])))
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


def _locate(cls: type[BaseModel] | None, loc: tuple[int | str, ...]) -> tuple[list[str], Any]:
    """The keys an error's location names as written, and the type of the last one. Pydantic
    adds the union member it tried (`trainer.loss.ppo_clip.clip`, `lora.target_modules.str`):
    no key the user wrote."""
    keys: list[str] = []
    node: Any = cls
    for part in loc:
        node = _unwrap(node)
        if get_origin(node) in (Union, UnionType):
            node = _union_member(node, part)
            continue
        if get_origin(node) in (list, dict):  # (an entry of [[envs]], a table's value)
            node = get_args(node)[-1]
        else:
            fields = node.model_fields if isinstance(node, type) and issubclass(node, BaseModel) else {}
            node = fields[part].annotation if part in fields else None
        keys.append(str(part))
    return keys, node


def key_path(cls: type[BaseModel] | None, loc: tuple[int | str, ...]) -> str:
    """The dotted key an error's location names (see `_locate`)."""
    return ".".join(_locate(cls, loc)[0]) or "<root>"


def _section_keys(cls: type[BaseModel] | None, loc: tuple[int | str, ...]) -> list[str]:
    """The keys of the section that holds the key at `loc` (for an unknown key's suggestion)."""
    node = _unwrap(_locate(cls, loc[:-1])[1] if loc[:-1] else cls)
    if get_origin(node) in (Union, UnionType) and len(loc) >= 2:  # (pydantic names the member)
        node = _unwrap(_union_member(node, loc[-2]))
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _annotation_at(cls: type[BaseModel], keys: Sequence[str]) -> Any:
    """The type of the key `keys` name (through optional sections, each member of a union of
    sections that has the key, and a table's values); None where there is no such key."""
    node: Any = cls
    for key in keys:
        found = []
        members = get_args(_unwrap(node)) if get_origin(_unwrap(node)) in (Union, UnionType) else [node]
        for member in members:
            member = _unwrap(member)
            if isinstance(member, type) and issubclass(member, BaseModel):
                if key in member.model_fields:
                    found.append(member.model_fields[key].annotation)
            elif get_origin(member) is dict:
                found.append(get_args(member)[1])
        if not found:
            return None
        node = found[0] if len(found) == 1 else Union[tuple(found)]  # noqa: UP007 (built at run time)
    return node


def cli_value(cls: type[BaseModel], key: str, text: str) -> Any:
    """A command-line value read as its key's type: its TOML value when the key takes that (`3`,
    `[0.8, 0.9]`, `"quoted"`), else that value or the text as the key's type reads them (`1e3` or
    `64.0` for an integer, `.5` for a number, `no` or `0` for a boolean, `32` or `04:00:00` for a
    text key), else its TOML value, which validation then refuses naming the key. A table (or a
    list of tables) is left to validation as it stands, as if from a file."""
    text = str(text)
    parsed = parse_value(text)
    if isinstance(parsed, CliText):
        parsed = text  # (a plain str from here on)
    annotation = _annotation_at(cls, key.replace("-", "_").split("."))
    if annotation is None or text == "":  # (an unknown key: validation names it; "" is no path)
        return parsed
    adapter = TypeAdapter(annotation)
    try:
        adapter.validate_python(parsed, strict=True)
        return parsed
    except ValidationError:
        if isinstance(parsed, dict) or (
            isinstance(parsed, list) and any(isinstance(v, dict) for v in parsed)
        ):
            return parsed
    for value in (parsed, str(text)):
        try:
            return adapter.validate_python(value)
        except ValidationError:
            pass
    return parsed


COMMAND_LINE = "the command line"


def _leaves(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The keys of `data`'s values (a table's keys, not the table; a list is one value)."""
    keys: list[tuple[str, ...]] = []
    for key, value in data.items():
        path = (*prefix, str(key))
        keys += _leaves(value, path) if isinstance(value, dict) and value else [path]
    return keys


def _set_origin(origins: dict[tuple[str, ...], str], key: tuple[str, ...], source: str) -> None:
    """`key` now comes from `source`: what an earlier source gave inside it, or as a value where
    it is now a table, is gone."""
    for known in list(origins):
        if known[: len(key)] == key or key[: len(known)] == known:
            del origins[known]
    origins[key] = source


def _origin(origins: dict[tuple[str, ...], str], keys: Sequence[str]) -> str | None:
    """The file an error's key came from (or the list or table that holds it); for a section's
    own check (`keys` a section, or [] for the whole config), the files that set its keys unless
    the command line set one of them too. None for keys from the command line or the defaults."""
    for n in range(len(keys), 0, -1):
        if tuple(keys[:n]) in origins:
            source = origins[tuple(keys[:n])]
            return None if source == COMMAND_LINE else source
    inside = {s for k, s in origins.items() if k[: len(keys)] == tuple(keys)}
    return None if COMMAND_LINE in inside else ", ".join(sorted(inside)) or None


def _got(kind: str, given: Any, in_file: bool) -> str:
    """How an error shows the value given: for a number or a boolean written as a string in a
    file, or an integer written as a float, with what to write instead."""
    if kind in ("int_type", "float_type", "bool_type") and isinstance(given, str) and in_file:
        return f"got the string {given!r}: write it without quotes"
    if kind == "int_type" and isinstance(given, float) and given.is_integer():
        return f"got {given!r}: write {int(given)}"
    return f"got {given!r}"


MAX_KEYS_LISTED = 16
"""An unknown key with no close match lists its section's keys, when it has at most this many."""


def format_validation_error(
    error: ValidationError,
    cls: type[BaseModel] | None = None,
    origins: dict[tuple[str, ...], str] | None = None,
) -> str:
    """All of `error`'s problems in one line, keys named as written (given `cls`, the validated
    model), each after the file it came from (given `origins`: key → file, from build_config).
    An unknown key gets the closest known one as a suggestion, else its section's keys (up to
    MAX_KEYS_LISTED). A shared field's problem is named once, not again for each section it
    flowed into."""
    problems: dict[tuple[str, str], str] = {}  # (key, what is wrong) → the text naming both
    for item in error.errors():
        loc = item["loc"]
        keys, node = _locate(cls, loc)
        key = ".".join(keys) or "<root>"
        source = _origin(origins, keys) if origins is not None else None
        given = item.get("input")
        if item["type"] == "extra_forbidden":
            known = _section_keys(cls, loc)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            if close:
                suggestion = f" (did you mean '{'.'.join([*keys[:-1], close[0]])}'?)"
            elif 0 < len(known) <= MAX_KEYS_LISTED:
                section = f"[{'.'.join(keys[:-1])}]" if len(keys) > 1 else "the top level"
                suggestion = f" ({section} has: {', '.join(sorted(known))})"
            else:
                suggestion = ""
            what, text = "unknown", f"unknown key '{key}'{suggestion}"
        elif item["type"] == "missing":
            what, text = "missing", f"missing required key '{key}'"
        elif item["type"] == "union_tag_invalid" and (tag := union_tag_field(node)) is not None:
            key = f"{key}.{tag}"
            expected = item.get("ctx", {}).get("expected_tags", "")
            what = f"{item['ctx']['tag']!r} is not one of {expected}"
            text = f"'{key}': {what}"
        else:
            scalar = not isinstance(given, dict | list)
            what = item["msg"] + (f" (got {given!r})" if scalar else "")
            shown = item["msg"] + (f" ({_got(item['type'], given, source is not None)})" if scalar else "")
            text = f"'{key}': {shown}" if loc else what  # (a whole-config check names its keys)
        problems.setdefault((key, what), f"{source}: {text}" if source else text)
    shared = [(key, what) for key, what in problems if key.split(".")[0] in SHARED_FIELDS]
    texts = [
        text
        for (key, what), text in problems.items()
        if not any(key.endswith(f".{top}") and what == same for top, same in shared)
    ]
    return "invalid config: " + "; ".join(texts)


def build_config(cls: type[C], files: Sequence[Path] = (), overrides: Sequence[tuple[str, Any]] = ()) -> C:
    """`cls` from `files` merged left to right, then `overrides` (key, value): a CliText value is
    read as its key's type (`cli_value`). Validated strictly (Section): an error names each key
    and the file it came from."""
    data: dict = {}
    origins: dict[tuple[str, ...], str] = {}
    for path in files:
        table = read_toml(path)
        for key in _leaves(table):
            _set_origin(origins, key, str(path))
        data = deep_merge(data, table)
    for key, value in overrides:
        if isinstance(value, CliText):
            value = cli_value(cls, key, value)
        set_path(data, key, value)
        _set_origin(origins, tuple(key.replace("-", "_").split(".")), COMMAND_LINE)
    data = spread_shared_fields(cls, data)
    try:
        return cls.model_validate(data, strict=True)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, cls, origins)) from None


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
    files, overrides, flags = split_args(sys.argv[1:] if argv is None else argv, raw=True)
    if flags["help"]:
        print(f"usage: {prog} [@ CONFIG.toml ...] [--section.key VALUE ...] [--dry-run]\n\nfields:")
        print("\n".join(describe_fields(cls)))
        raise SystemExit(0)
    config = build_config(cls, files, overrides)
    if flags["dry_run"]:
        print(to_toml(config), end="")
        raise SystemExit(0)
    return config
