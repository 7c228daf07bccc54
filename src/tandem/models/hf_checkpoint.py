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
the expected shape and a dtype the loader reads, and fails with one line naming the first that
does not; a missing or truncated safetensors file fails the same way, naming the file.

Block-FP8 checkpoints (config.json's `quantization_config` with quant_method "fp8" and
`weight_block_size` [bn, bk], the layout of DeepSeek-V3 and Qwen3-*-FP8) are dequantized as they
are read: an e4m3 tensor `<name>` comes with float32 `<name>_scale_inv` [⌈N/bn⌉, ⌈K/bk⌉], one
scale per block (the last blocks cropped where N or K is not a multiple), and a region of it reads
as e4m3 × its blocks' scales in fp32. Each rank still reads only its region (and the scales of the
blocks that region touches). Any other quantization method is refused.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tandem.models.fp8_blocks import dequantize_blocks

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # block-FP8: the scales of tensor <name> are <name>_scale_inv


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
    """Reads slices of the tensors of a (possibly sharded) safetensors checkpoint directory;
    `quantization` is its config's quantization_config (None, or block FP8: see the module
    docstring)."""

    def __init__(self, directory: Path, quantization: dict | None = None) -> None:
        self.directory = Path(directory)
        self.block = fp8_block(quantization, self.directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index} is not a safetensors index: {_first_line(e)}") from None
        elif (self.directory / SINGLE_FILE).is_file():
            weight_map = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.weight_map: dict[str, str] = weight_map
        self._files: dict[str, object] = {}

    def _open(self, filename: str) -> object:
        path = self.directory / filename
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (the index lists it): an incomplete download?")
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path} cannot be read ({_first_line(e)}): a truncated file?") from None

    def check_files(self) -> None:
        """Open every file of the checkpoint (their headers): a missing or truncated one fails."""
        for filename in sorted(set(self.weight_map.values())):
            if filename not in self._files:
                self._files[filename] = self._open(filename)

    def _file(self, name: str) -> object:
        filename = self.weight_map[name]
        if filename not in self._files:
            self._files[filename] = self._open(filename)
        return self._files[filename]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def stored_dtype(self, name: str) -> str:
        """The tensor's dtype as the file names it: "BF16", "F8_E4M3", "I64"..."""
        return self._file(name).get_slice(name).get_dtype()

    def is_fp8(self, name: str) -> bool:
        return self.stored_dtype(name) == "F8_E4M3"

    def dtype(self, name: str) -> torch.dtype:
        """The dtype `read` returns for the tensor: float32 for a dequantized FP8 one."""
        return torch.float32 if self.is_fp8(name) else _SAFETENSORS_DTYPES[self.stored_dtype(name)]

    def read(self, name: str, region: Region) -> torch.Tensor:
        if self.is_fp8(name):
            return self._dequantized(name, region)
        return self._slice(name, region)

    def _slice(self, name: str, region: Region) -> torch.Tensor:
        try:
            return self._file(name).get_slice(name)[tuple(slice(start, stop) for start, stop in region)]
        except SafetensorError as e:
            raise CheckpointError(
                f"{self.directory / self.weight_map[name]}: cannot read {name} ({_first_line(e)})"
            ) from None

    def _dequantized(self, name: str, region: Region) -> torch.Tensor:
        """The region of FP8 tensor `name`, times the scales of its blocks (fp32)."""
        (r0, r1), (c0, c1) = region
        bn, bk = self.block
        scales = ((r0 // bn, -(-r1 // bn)), (c0 // bk, -(-c1 // bk)))
        return dequantize_blocks(
            self._slice(name, region),
            self._slice(name + SCALE_SUFFIX, scales),
            block=self.block,
            offset=(r0, c0),
        )

    def check_dtype(self, name: str, shape: tuple[int, ...]) -> None:
        """Fail unless the loader reads tensor `name` (of `shape`): a float one, or a block-FP8 one
        with scales of the right shape."""
        stored = self.stored_dtype(name)
        where = f"{self.directory}: tensor {name}"
        if stored in _FLOATS:
            return
        if stored != "F8_E4M3":
            raise CheckpointError(
                f"{where} is {stored}: tandem's trainer reads float tensors (and block-FP8 e4m3 ones)"
            )
        if self.block is None:
            raise CheckpointError(
                f"{where} is FP8 (F8_E4M3) but config.json has no quantization_config with "
                "quant_method 'fp8' and weight_block_size"
            )
        scale = name + SCALE_SUFFIX
        if scale not in self.weight_map:
            raise CheckpointError(f"{where} is FP8 (F8_E4M3) without its scales {scale}")
        want = tuple(-(-size // block) for size, block in zip(shape, self.block, strict=False))
        if len(shape) != 2 or self.shape(scale) != want or self.stored_dtype(scale) not in _FLOATS:
            raise CheckpointError(
                f"{self.directory}: tensor {scale} is {self.stored_dtype(scale)} {list(self.shape(scale))}, "
                f"the scales of {name} {list(shape)} in blocks of {list(self.block)} must be float {list(want)}"
            )


def fp8_block(quantization: dict | None, directory: Path) -> tuple[int, int] | None:
    """The (rows, columns) of a block-FP8 checkpoint's scale blocks; None when not quantized.
    Any other quantization_config fails, naming its method."""
    if quantization is None:
        return None
    if hasattr(quantization, "to_dict"):  # a transformers QuantizationConfig
        quantization = quantization.to_dict()
    method = quantization.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"{directory}: quantization_config quant_method = {method!r} is not supported: tandem's "
            "trainer loads unquantized checkpoints and block-FP8 ones (quant_method 'fp8')"
        )
    block = quantization.get("weight_block_size", [128, 128])  # transformers' default
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3" or not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{directory}: quantization_config fp8 with fmt = {fmt!r}, weight_block_size = {block!r} is not "
            "supported: tandem's trainer dequantizes e4m3 weights with 2-D block scales"
        )
    return (block[0], block[1])


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_FLOATS = ("F64", "F32", "F16", "BF16")


def check_sources(
    reader: SafetensorsReader, layouts: dict[str, Layout], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Fail with one line on the first checkpoint tensor that is missing, has the wrong shape or a
    dtype the loader does not read (or on a checkpoint file that is missing or unreadable)."""
    for param, layout in layouts.items():
        for name, shape in expected_sources(layout, shapes[param]):
            if name not in reader.weight_map:
                raise CheckpointError(f"{reader.directory}: tensor {name} is missing (needed for {param})")
            found = reader.shape(name)
            if found != shape:
                raise CheckpointError(
                    f"{reader.directory}: tensor {name} has shape {list(found)}, the model needs {list(shape)}"
                )
            reader.check_dtype(name, shape)


def sources_read(reader: SafetensorsReader, name: str) -> tuple[str, ...]:
    """The checkpoint tensors reading tensor `name` takes: itself, and an FP8 tensor's scales."""
    return (name, name + SCALE_SUFFIX) if reader.is_fp8(name) else (name,)


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
