"""Hugging Face safetensors ↔ tandem's parameters, region by region, without full copies.

A family's state-dict adapter describes each tandem parameter as a `Layout` of checkpoint
tensors: a `Source` (one tensor, same shape), a `Concat` of layouts along dim 0 (q/k/v fused
into one projection) or a `Stack` of equal layouts along a new dim 0 (experts). With that one
description both directions follow:

- load: every rank reads, for each of its parameter shards, only the rows (and expert slices)
  that shard covers — straight from the safetensors files, cast to the parameter's dtype —
  so no rank ever holds the full model;
- save: a full tensor (gathered one parameter at a time) is split back into the checkpoint's
  tensors, which are written in shards of at most `max_shard_bytes` with the usual
  `model.safetensors.index.json`, so plain transformers loads the result.

Before anything is read, `check_sources` verifies that every tensor a layout names exists with
the expected shape, and fails with one line naming the first that does not.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Source:
    name: str


@dataclass(frozen=True)
class Concat:
    parts: tuple["Layout", ...]
    sizes: tuple[int, ...]  # dim-0 size of each part


@dataclass(frozen=True)
class Stack:
    parts: tuple["Layout", ...]


Layout = Source | Concat | Stack
Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing tensor, wrong shape, unreadable file."""


def expected_sources(layout: Layout, shape: tuple[int, ...]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every checkpoint tensor a parameter of `shape` is made of, with the shape it must have."""
    if isinstance(layout, Source):
        yield layout.name, tuple(shape)
    elif isinstance(layout, Concat):
        if sum(layout.sizes) != shape[0]:
            raise ValueError(f"concat sizes {layout.sizes} do not add up to {shape[0]}")
        for part, size in zip(layout.parts, layout.sizes, strict=True):
            yield from expected_sources(part, (size, *shape[1:]))
    else:
        if len(layout.parts) != shape[0]:
            raise ValueError(f"{len(layout.parts)} stacked parts for a dim 0 of {shape[0]}")
        for part in layout.parts:
            yield from expected_sources(part, tuple(shape[1:]))


class SafetensorsReader:
    """Reads slices of the tensors of a (possibly sharded) safetensors checkpoint directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE_FILE).is_file():
            with safe_open(self.directory / SINGLE_FILE, framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.weight_map: dict[str, str] = weight_map
        self._files: dict[str, object] = {}

    def _file(self, name: str) -> object:
        filename = self.weight_map[name]
        if filename not in self._files:
            self._files[filename] = safe_open(self.directory / filename, framework="pt")
        return self._files[filename]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._file(name).get_slice(name).get_dtype()]

    def read(self, name: str, region: Region) -> torch.Tensor:
        return self._file(name).get_slice(name)[tuple(slice(start, stop) for start, stop in region)]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def check_sources(
    reader: SafetensorsReader, layouts: dict[str, Layout], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Fail with one line on the first checkpoint tensor that is missing or has the wrong shape."""
    for param, layout in layouts.items():
        for name, shape in expected_sources(layout, shapes[param]):
            if name not in reader.weight_map:
                raise CheckpointError(f"{reader.directory}: tensor {name} is missing (needed for {param})")
            found = reader.shape(name)
            if found != shape:
                raise CheckpointError(
                    f"{reader.directory}: tensor {name} has shape {list(found)}, the model needs {list(shape)}"
                )


def read_region(reader: SafetensorsReader, layout: Layout, region: Region) -> torch.Tensor:
    """The part `region` of the parameter that `layout` describes, read from the checkpoint."""
    if any(start >= stop for start, stop in region):  # an empty shard (FSDP pads uneven splits)
        return torch.empty(
            [stop - start for start, stop in region], dtype=reader.dtype(_first_source(layout))
        )
    if isinstance(layout, Source):
        return reader.read(layout.name, region)
    (start, stop), rest = region[0], region[1:]
    pieces = []
    if isinstance(layout, Concat):
        offset = 0
        for part, size in zip(layout.parts, layout.sizes, strict=True):
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                pieces.append(read_region(reader, part, ((lo - offset, hi - offset), *rest)))
            offset += size
        return torch.cat(pieces)
    return torch.stack([read_region(reader, layout.parts[e], rest) for e in range(start, stop)])


def _first_source(layout: Layout) -> str:
    while not isinstance(layout, Source):
        layout = layout.parts[0]
    return layout.name


def split_full(layout: Layout, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors (name, tensor) that a full parameter is made of."""
    if isinstance(layout, Source):
        yield layout.name, tensor
    elif isinstance(layout, Concat):
        for part, piece in zip(layout.parts, tensor.split(list(layout.sizes)), strict=True):
            yield from split_full(part, piece)
    else:
        for part, piece in zip(layout.parts, tensor.unbind(0), strict=True):
            yield from split_full(part, piece)


class ShardedSafetensorsWriter:
    """Writes named tensors as they come into safetensors shards of at most `max_shard_bytes`.

    `close()` names the shards model-0000i-of-0000n.safetensors with an index (or a single
    model.safetensors when one shard suffices), as transformers' save_pretrained does.
    """

    def __init__(self, directory: Path, max_shard_bytes: int = 5 * 2**30) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.detach().contiguous().cpu()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, self.directory / f".shard-{len(self.shards)}", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            (self.directory / ".shard-0").rename(self.directory / SINGLE_FILE)
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            filename = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.directory / f".shard-{i}").rename(self.directory / filename)
            weight_map.update(dict.fromkeys(names, filename))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
