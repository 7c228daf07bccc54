"""Every key of a config class with its effective default: the one walk behind `--help`
(tandem.config.loader) and docs/config-reference.md (tandem.config.reference).

Sections are walked into, optional ones (`X | None`) too; a union of sections (the trainer's
`loss`) lists its `type` key and then each member's keys, naming the types each belongs to.
A default comes from the enclosing section's default instance when it has one
(`weights: WeightsConfig = WeightsConfig(transport="auto")` makes weights.transport's "auto").
A config whose command fills in some keys itself (rl: each process's section from the top-level
keys) gives the instance a run gets with nothing set through a classmethod `effective_defaults()`.
"""

from dataclasses import dataclass, replace
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Tag


@dataclass(frozen=True)
class Key:
    """One key of a config, or a section (a table; its keys follow it in the walk)."""

    path: str
    annotation: Any
    required: bool
    default: Any  # the effective default (None when required)
    description: str
    types: tuple[str, ...] = ()  # in a union of sections: the `type`s it belongs to; () = every one
    section: bool = False


def is_optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, UnionType) and type(None) in get_args(annotation)


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _is_section(annotation: Any) -> bool:
    annotation = _strip(annotation)
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _choices(annotation: Any) -> list[Any]:
    """A union's members but None (the annotation itself when it is not a union)."""
    annotation = _strip(annotation)
    if get_origin(annotation) in (Union, UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _tag(member: Any) -> str:
    """A union member's tag: its `Tag(...)`, else its one-value Literal field, else its class name."""
    if get_origin(member) is Annotated:
        for meta in get_args(member)[1:]:
            if isinstance(meta, Tag):
                return meta.tag
    cls = _strip(member)
    for field in cls.model_fields.values():
        if get_origin(field.annotation) is Literal and len(get_args(field.annotation)) == 1:
            return str(get_args(field.annotation)[0])
    return cls.__name__


def _tag_field(members: list[tuple[str, type[BaseModel]]]) -> str | None:
    """The field every member declares as `Literal[its tag]` (the discriminator, `type`)."""
    names = None
    for tag, cls in members:
        own = {name for name, field in cls.model_fields.items() if get_args(field.annotation) == (tag,)}
        names = own if names is None else names & own
    return min(names) if names else None


def union_tag_field(annotation: Any) -> str | None:
    """The key that picks a union of sections' member (the trainer's `loss.type`), else None."""
    choices = _choices(annotation)
    if len(choices) < 2 or not all(_is_section(c) for c in choices):
        return None
    return _tag_field([(_tag(c), _strip(c)) for c in choices])


def walk_keys(cls: type[BaseModel], prefix: str = "", value: BaseModel | None = None) -> list[Key]:
    """`cls`'s keys: its own values first, then each section's key followed by that section's keys.
    `value` is the section's default instance, whose values are the defaults (at the top: the
    class's effective_defaults(), when it has one)."""
    if value is None and not prefix and hasattr(cls, "effective_defaults"):
        value = cls.effective_defaults()
    own: list[Key] = []
    nested: list[Key] = []
    for name, field in cls.model_fields.items():
        if value is not None:
            required, default = False, getattr(value, name)
        else:
            required = field.is_required()
            default = None if required else field.get_default(call_default_factory=True)
        key = Key(f"{prefix}{name}", field.annotation, required, default, field.description or "")
        choices = _choices(field.annotation)
        if not all(_is_section(c) for c in choices):
            own.append(key)
            continue
        nested.append(replace(key, section=True))
        if len(choices) == 1:
            inner = default if isinstance(default, BaseModel) else None
            nested += walk_keys(_strip(choices[0]), f"{key.path}.", inner)
        else:
            nested += _union_keys(key, [(_tag(c), _strip(c)) for c in choices])
    return own + nested


def _union_keys(union: Key, members: list[tuple[str, type[BaseModel]]]) -> list[Key]:
    """The keys of a union of sections: its tag key, then each member's keys once, with the
    types they belong to (none named when every member has the key, with the same default)."""
    tags = tuple(tag for tag, _ in members)
    tag_field = _tag_field(members)
    keys: list[Key] = []
    if tag_field is not None:
        default_tag = next(
            (tag for tag, cls in members if type(union.default) is cls), None
        )  # the member the default instance is
        keys.append(
            Key(
                f"{union.path}.{tag_field}",
                Literal[tags],  # type: ignore[valid-type]
                default_tag is None,
                default_tag,
                "Picks the variant; a key below that names types belongs to those types only.",
            )
        )
    merged: list[Key] = []
    for tag, cls in members:
        value = union.default if type(union.default) is cls else None
        for key in walk_keys(cls, f"{union.path}.", value):
            if key.path == f"{union.path}.{tag_field}":
                continue
            key = replace(key, types=(tag,))
            bare = replace(key, types=())
            same = next((i for i, k in enumerate(merged) if replace(k, types=()) == bare), None)
            if same is None:
                merged.append(key)
            else:
                merged[same] = replace(merged[same], types=(*merged[same].types, tag))
    return keys + [replace(k, types=()) if k.types == tags else k for k in merged]
