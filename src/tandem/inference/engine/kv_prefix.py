"""A prompt's keys and values moved from one engine to another: prefill on other servers.

A prefill server computes a prompt; the decode server that generates from it takes the prompt's
keys and values into its prefix cache instead of computing them (docs/inference-engine.md,
"Prefill on other servers"). What moves (`Prefix`) is the prompt's full blocks as they lie in the
exporter's paged cache: the tokens they hold, from the prompt's start; each cache part (keys and
values; or a latent and indexer keys) of the blocks after the first `skip`, which the importer
said it holds already, as [layers, blocks − skip, block_size, ...]; the weight version, block
size and cache layout. Two encodings: safetensors bytes (`to_bytes`, over HTTP) and a staging
buffer shared between the two processes (`pack`/`unpack`, kv_staging.py).

Invariants:
- Only blocks the prefix cache can reuse move: full blocks before the prompt's last token (the
  importer always computes at least the last token, whose logits it samples from).
- The importer adopts blocks (BlockManager.adopt) only when its weight version, block size and
  cache layout equal the exporter's and the blocks hold its prompt's tokens, so an adopted block
  holds what computing it there would have written. Anything else is refused whole with a
  ValueError naming why; the request then computes its prompt itself. Nothing half-written is
  ever registered: blocks are written in the same core command that registers them.
- Blocks are chained by their tokens as the prefix cache chains them, and the importer hashes
  them itself: hashes do not travel (Python's hash of None differs between processes before 3.12).
"""

import json
from dataclasses import dataclass

import torch
from safetensors.torch import load, save

from tandem.inference.engine.block_manager import BlockManager, reusable_blocks
from tandem.inference.engine.transfer import host_to_device

METADATA_KEYS = ("weight_version", "block_size", "skip_blocks", "layout")


@dataclass
class Prefix:
    """A prompt's exported blocks."""

    token_ids: list[int]  # the tokens the blocks hold (a whole number of blocks)
    skip_blocks: int  # the first blocks, which the importer holds: not in `parts`
    weight_version: int
    block_size: int
    layout: list[list]  # layout() of the exporter's cache
    parts: list[torch.Tensor]  # per cache part, [layers, blocks − skip, block_size, ...]


def cached_tokens(blocks: BlockManager, token_ids: list[int]) -> int:
    """Tokens at the start of `token_ids` whose keys and values this cache holds and would reuse."""
    return (
        len(blocks.lookup(token_ids, reusable_blocks(len(token_ids), blocks.block_size))) * blocks.block_size
    )


def layout(cache: list[torch.Tensor]) -> list[list]:
    """Each cache part's per-block shape and dtype, with the layer count: what must match."""
    return [[part.shape[0], list(part.shape[2:]), str(part.dtype)] for part in cache]


def export_prefix(
    blocks: BlockManager,
    cache: list[torch.Tensor],
    weight_version: int,
    token_ids: list[int],
    skip_tokens: int,
) -> Prefix:
    """The keys and values this cache holds for `token_ids`' reusable blocks, as far as they are
    registered, less the first `skip_tokens` (a multiple of the block size: what the importer
    holds); the parts are gathered on the cache's device."""
    size = blocks.block_size
    if skip_tokens % size:
        raise ValueError(f"skip_tokens must be a multiple of the block size {size}, got {skip_tokens}")
    found = blocks.lookup(token_ids, reusable_blocks(len(token_ids), size))
    skip = min(skip_tokens // size, len(found))
    index = torch.tensor(found[skip:], dtype=torch.int64, device=cache[0].device)
    parts = [part.index_select(1, index) for part in cache]
    return Prefix(token_ids[: len(found) * size], skip, weight_version, size, layout(cache), parts)


def adopt_prefix(
    blocks: BlockManager, cache: list[torch.Tensor], weight_version: int, token_ids: list[int], prefix: Prefix
) -> int:
    """Adopt `prefix` for `token_ids` into the prefix cache; returns how many of `token_ids`' first
    tokens the cache now holds. Raises ValueError (nothing changed) for blocks that do not fit:
    other weights, block size, layout or tokens. The copies into the cache are queued on the
    device's stream (the caller waits for them if it must release the source)."""
    size = blocks.block_size
    if prefix.weight_version != weight_version:
        raise ValueError(
            f"the prefill server computed them with weight version {prefix.weight_version}; "
            f"this server serves {weight_version}"
        )
    if prefix.block_size != size:
        raise ValueError(f"block size {prefix.block_size} there, {size} here")
    if prefix.layout != layout(cache):
        raise ValueError(f"cache layout {json.dumps(prefix.layout)} there, {json.dumps(layout(cache))} here")
    held = prefix.token_ids
    num_blocks = len(held) // size
    if num_blocks > reusable_blocks(len(token_ids), size) or held != token_ids[: len(held)]:
        raise ValueError("the exported blocks hold other tokens than this prompt's")
    skip = prefix.skip_blocks
    if len(prefix.parts) != len(cache):
        raise ValueError(f"{len(prefix.parts)} cache parts there, {len(cache)} here")
    for j, (given, part) in enumerate(zip(prefix.parts, cache, strict=True)):
        expected = (part.shape[0], num_blocks - skip, *part.shape[2:])
        if tuple(given.shape) != expected or given.dtype != part.dtype:
            raise ValueError(
                f"part.{j}: expected {part.dtype} {list(expected)}, got {given.dtype} {list(given.shape)}"
            )
    to_write = blocks.adopt(token_ids, skip, num_blocks)
    if to_write:
        src = torch.tensor([i - skip for i, _ in to_write], dtype=torch.int64)
        dst = torch.tensor([block for _, block in to_write], dtype=torch.int64, device=cache[0].device)
        for given, part in zip(prefix.parts, cache, strict=True):
            if given.device.type == "cpu":  # (the rows this cache lacks, through pinned memory)
                rows = host_to_device(given.index_select(1, src), part.device)
            else:  # (another GPU's buffer: all of it, peer to peer, then the rows here)
                rows = given.to(part.device, non_blocking=True).index_select(1, src.to(part.device))
            part.index_copy_(1, dst, rows)
    return cached_tokens(blocks, token_ids)


# ---- safetensors bytes (HTTP) -------------------------------------------------------------------


def to_bytes(prefix: Prefix) -> bytes:
    """The prefix as safetensors: "token_ids", "part.J" and the rest in the metadata (copies the
    parts to the host: waits for the device)."""
    tensors = {"token_ids": torch.tensor(prefix.token_ids, dtype=torch.int64)}
    tensors |= {f"part.{j}": part.cpu() for j, part in enumerate(prefix.parts)}
    metadata = {
        "weight_version": str(prefix.weight_version),
        "block_size": str(prefix.block_size),
        "skip_blocks": str(prefix.skip_blocks),
        "layout": json.dumps(prefix.layout),
    }
    return save(tensors, metadata)


def from_bytes(data: bytes) -> Prefix:
    """`to_bytes`' prefix; ValueError for anything else."""
    try:
        tensors = load(data)
        length = int.from_bytes(data[:8], "little")  # (safetensors: the header's length, then the header)
        metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
        missing = [key for key in METADATA_KEYS if key not in metadata] + ["token_ids"] * (
            "token_ids" not in tensors
        )
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        count = len(json.loads(metadata["layout"]))
        return Prefix(
            tensors["token_ids"].tolist(),
            int(metadata["skip_blocks"]),
            int(metadata["weight_version"]),
            int(metadata["block_size"]),
            json.loads(metadata["layout"]),
            [tensors[f"part.{j}"] for j in range(count)],
        )
    except Exception as e:  # noqa: BLE001 — safetensors' own error type is not exported
        raise ValueError(f"not an exported prefix: {e}") from None


# ---- a staging buffer shared between two processes (kv_staging.py) ----------------------------


def pack(prefix: Prefix, buffer: torch.Tensor) -> dict:
    """Copy the prefix's parts into `buffer` (uint8, on their device, or host memory) one after
    another; returns the rest of the prefix and where each part lies (JSON-able). ValueError if
    the buffer is too small. The copies are queued: the caller waits before lending the buffer."""
    offset, where = 0, []
    for part in prefix.parts:
        nbytes = part.numel() * part.element_size()
        if offset + nbytes > buffer.numel():
            total = sum(p.numel() * p.element_size() for p in prefix.parts)
            raise ValueError(
                f"the prompt's blocks ({total} bytes) do not fit a staging buffer of {buffer.numel()}"
            )
        buffer[offset : offset + nbytes].view(part.dtype).view(part.shape).copy_(part)
        where.append([offset, list(part.shape), str(part.dtype).removeprefix("torch.")])
        offset += -(-nbytes // 256) * 256  # (each part aligned for any dtype's view)
    return {
        "token_ids": prefix.token_ids,
        "skip_blocks": prefix.skip_blocks,
        "weight_version": prefix.weight_version,
        "block_size": prefix.block_size,
        "layout": prefix.layout,
        "parts": where,
    }


def packed_bytes(packed: dict) -> int:
    """How many bytes of its buffer a `pack` description covers; ValueError if malformed."""
    try:
        return max((int(offset) + torch.Size(shape).numel() * getattr(torch, str(dtype)).itemsize
                    for offset, shape, dtype in packed["parts"]), default=0)  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"a malformed description of packed blocks: {e!r}") from None


def unpack(packed: dict, buffer: torch.Tensor) -> Prefix:
    """The prefix `pack` wrote into `buffer`, its parts as views of the buffer; ValueError for a
    description that does not fit the buffer."""
    try:
        parts = []
        for offset, shape, dtype in packed["parts"]:
            dt = getattr(torch, str(dtype), None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"not a dtype: {dtype!r}")
            nbytes = torch.Size(shape).numel() * dt.itemsize
            if offset < 0 or offset % 256 or offset + nbytes > buffer.numel():
                raise ValueError(f"a part at byte {offset} of {nbytes} bytes lies outside the staging buffer")
            parts.append(buffer[offset : offset + nbytes].view(dt).view(shape))
        return Prefix(
            [int(t) for t in packed["token_ids"]],
            int(packed["skip_blocks"]),
            int(packed["weight_version"]),
            int(packed["block_size"]),
            list(packed["layout"]),
            parts,
        )
    except (KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"a malformed staged prefix: {e!r}") from None
