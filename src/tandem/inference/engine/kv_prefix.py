"""A prompt's keys and values moved from one engine to another: prefill on other servers.

A prefill server computes a prompt; the decode server that generates from it takes the prompt's
keys and values into its prefix cache instead of computing them (docs/inference-engine.md,
"Prefill on other servers"). What moves is the prompt's full blocks, as they lie in the
exporter's paged cache, in safetensors bytes:

    "token_ids"  int64 [blocks × block_size]: the tokens the blocks hold, from the prompt's start
    "part.J"     [layers, blocks − skip, block_size, ...]: cache part J (keys and values; or a
                 latent and indexer keys) of the blocks after the first `skip`, which the
                 importer said it holds already
    metadata     weight version, block size, skip, and the cache's layout

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

import torch
from safetensors.torch import load, save

from tandem.inference.engine.block_manager import BlockManager, reusable_blocks
from tandem.inference.engine.transfer import host_to_device

METADATA_KEYS = ("weight_version", "block_size", "skip_blocks", "layout")


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
) -> bytes:
    """The keys and values this cache holds for `token_ids`' reusable blocks, as far as they are
    registered, less the first `skip_tokens` (a multiple of the block size: what the importer
    holds). Copies them to the host (waits for the device)."""
    size = blocks.block_size
    if skip_tokens % size:
        raise ValueError(f"skip_tokens must be a multiple of the block size {size}, got {skip_tokens}")
    found = blocks.lookup(token_ids, reusable_blocks(len(token_ids), size))
    skip = min(skip_tokens // size, len(found))
    index = torch.tensor(found[skip:], dtype=torch.int64, device=cache[0].device)
    tensors = {"token_ids": torch.tensor(token_ids[: len(found) * size], dtype=torch.int64)}
    for j, part in enumerate(cache):
        tensors[f"part.{j}"] = part.index_select(1, index).cpu()
    metadata = {
        "weight_version": str(weight_version),
        "block_size": str(size),
        "skip_blocks": str(skip),
        "layout": json.dumps(layout(cache)),
    }
    return save(tensors, metadata)


def import_prefix(
    blocks: BlockManager, cache: list[torch.Tensor], weight_version: int, token_ids: list[int], data: bytes
) -> int:
    """Adopt the exported blocks `data` for `token_ids` into the prefix cache; returns how many of
    `token_ids`' first tokens the cache now holds. Raises ValueError (nothing changed) for blocks
    that do not fit: other weights, block size, layout or tokens."""
    metadata, tensors = _read(data)
    size = blocks.block_size
    if int(metadata["weight_version"]) != weight_version:
        raise ValueError(
            f"the prefill server computed them with weight version {metadata['weight_version']}; "
            f"this server serves {weight_version}"
        )
    if int(metadata["block_size"]) != size:
        raise ValueError(f"block size {metadata['block_size']} there, {size} here")
    if json.loads(metadata["layout"]) != layout(cache):
        raise ValueError(f"cache layout {metadata['layout']} there, {json.dumps(layout(cache))} here")
    held = tensors["token_ids"].tolist()
    num_blocks = len(held) // size
    if num_blocks > reusable_blocks(len(token_ids), size) or held != token_ids[: len(held)]:
        raise ValueError("the exported blocks hold other tokens than this prompt's")
    skip = int(metadata["skip_blocks"])
    for j, part in enumerate(cache):
        given = tensors.get(f"part.{j}")
        expected = (part.shape[0], num_blocks - skip, *part.shape[2:])
        if given is None or tuple(given.shape) != expected or given.dtype != part.dtype:
            raise ValueError(f"part.{j}: expected {part.dtype} {list(expected)}, got {_describe(given)}")
    to_write = blocks.adopt(token_ids, skip, num_blocks)
    if to_write:
        src = torch.tensor([i - skip for i, _ in to_write], dtype=torch.int64)
        dst = torch.tensor([block for _, block in to_write], dtype=torch.int64, device=cache[0].device)
        for j, part in enumerate(cache):
            part.index_copy_(1, dst, host_to_device(tensors[f"part.{j}"].index_select(1, src), part.device))
    return cached_tokens(blocks, token_ids)


def _read(data: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """An exported prefix's metadata and tensors; ValueError for anything else."""
    try:
        tensors = load(data)
        length = int.from_bytes(data[:8], "little")  # (safetensors: the header's length, then the header)
        metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    except Exception as e:  # noqa: BLE001 — safetensors' own error type is not exported
        raise ValueError(f"not an exported prefix (safetensors): {e}") from None
    missing = [key for key in METADATA_KEYS if key not in metadata] + ["token_ids"] * (
        "token_ids" not in tensors
    )
    if missing:
        raise ValueError(f"not an exported prefix: no {', '.join(missing)}")
    return metadata, tensors


def _describe(tensor: torch.Tensor | None) -> str:
    return "nothing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
