"""Which base model a LoRA checkpoint's adapters were trained on: recorded at save, checked at resume.

A LoRA checkpoint holds the adapters and their optimizer state only; a resume reads the base
weights from `model.name` again. `check_fits` compares tensor names and shapes, so a base of the
same shapes with other weights (another fine-tune of the architecture, or the same directory or hub
name now holding other weights) fits, and the old adapters would silently train on a new base.
trainer_state.pt therefore records the base as `{"name": model.name as configured, "fingerprint":
sha256 hex}`, and a resume whose base has another fingerprint is refused in one line naming both,
before the checkpoint's shards are read. The same fingerprint under another name (the model moved,
or a hub name now given as its local download) resumes, with a note. A checkpoint written before
the record existed resumes unchecked, with one warning.

The fingerprint is a SHA-256 over config.json's bytes, the name and size of every weight file, each
safetensors file's header (every tensor's name, dtype, shape and offsets) and the first
`TENSOR_BYTES` bytes of every tensor's data. Only the last part tells fine-tunes of one
architecture apart: in one dtype they have the same config.json, files, sizes and headers (the two
tiny models of tests/trainer/test_checkpoint_mismatch.py differ only in their random seed). Training
a tensor moves essentially every element of it (a merged LoRA adapter too: W + BA changes every
entry of W), so its leading 32 bf16 values differ wherever either model trained it. The cost is one
small read per tensor, a few ten thousand reads (some MB) on the largest MoE checkpoints, against the
hundreds of GB that loading the base reads right afterwards; hashing whole files would read the model
a second time, and config.json or sizes alone do not see another fine-tune. A `*.bin` weight file
(pickled, no header to index) adds its name, size and `BIN_BYTES` from its middle. Rank 0 computes
it and broadcasts it, so a shared filesystem is read once per run, not once per rank.

Full fine-tuning needs none of this: its checkpoint holds every parameter, and a resume builds the
model without reading the base's weights (load_weights off) and fills all of them from the
checkpoint, so another base of the same shapes changes no weight (check_fits refuses other shapes).
"""

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tandem.cli import UserError
from tandem.trainer.parallel import World

TENSOR_BYTES = 64
BIN_BYTES = 64 * 1024
RECORD = "base_model"
"""The key of the record in trainer_state.pt."""


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: those its index files name, else every *.safetensors and *.bin."""
    named = set()
    for index in directory.glob("*.index.json"):
        try:
            named |= set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    if named:
        return [directory / name for name in sorted(named)]
    return sorted([*directory.glob("*.safetensors"), *directory.glob("*.bin")])


def fingerprint(directory: Path) -> str:
    """SHA-256 hex of config.json, the weight files' names and sizes and samples of their content
    (the module docstring says which and why)."""
    digest = hashlib.sha256()
    digest.update((directory / "config.json").read_bytes())
    for path in weight_files(directory):
        size = path.stat().st_size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as file:
            if path.suffix == ".safetensors":
                _safetensors_samples(file.fileno(), size, digest)
            else:
                digest.update(os.pread(file.fileno(), BIN_BYTES, max(0, size // 2 - BIN_BYTES // 2)))
    return digest.hexdigest()


def _safetensors_samples(fd: int, size: int, digest: Any) -> None:
    """The header and the leading TENSOR_BYTES of every tensor, in file order, into `digest`."""
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if not 0 < length <= size - 8:
        digest.update(os.pread(fd, BIN_BYTES, 0))  # not a safetensors file: what it starts with
        return
    header = os.pread(fd, length, 8)
    digest.update(header)
    try:
        entries = json.loads(header)
        offsets = sorted(e["data_offsets"] for k, e in entries.items() if k != "__metadata__")
    except (ValueError, KeyError, TypeError, AttributeError):
        return  # (the loader names an unreadable header; its bytes are in the digest)
    for begin, end in offsets:
        digest.update(os.pread(fd, min(TENSOR_BYTES, end - begin), 8 + length + begin))


def base_identity(name: str, locate: Callable[[str], Path], world: World) -> dict[str, str]:
    """The record of base model `name` (as configured), read from the local directory `locate(name)`
    gives: computed by rank 0, returned on every rank (collective; a failure fails every rank)."""
    found: list[Any] = [None]
    if world.is_main:
        try:
            found[0] = {"name": name, "fingerprint": fingerprint(locate(name))}
        except Exception as e:  # (whatever the filesystem or the hub raises: every rank must hear of it)
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            found[0] = f"cannot fingerprint the base model {name}: {line}"
    if world.size > 1:
        dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        raise UserError(found[0])
    return found[0]


def check_base(
    path: Path, saved: dict[str, str] | None, current: dict[str, str] | None, world: World
) -> None:
    """Refuse (UserError, one line naming both) a resume from checkpoint `path`, whose record is
    `saved`, on a base whose record `current` has another fingerprint. Rank 0 notes a renamed base
    of the same fingerprint, and warns about a checkpoint without a record (written before tandem
    kept one). `current` None (not LoRA): nothing to check."""
    if current is None:
        return
    if saved is None:
        if world.is_main:
            print(
                f"trainer: warning: {path} does not record which base model its LoRA adapters were "
                f"trained on (written by an older tandem): resuming on {current['name']} unchecked",
                flush=True,
            )
        return
    if saved["fingerprint"] != current["fingerprint"]:
        same_name = " (the same name, other weights or config)" if saved["name"] == current["name"] else ""
        raise UserError(
            f"cannot resume from {path}: its LoRA adapters were trained on base model {saved['name']} "
            f"(fingerprint {saved['fingerprint'][:12]}), the run's model.name is {current['name']} "
            f"(fingerprint {current['fingerprint'][:12]}){same_name}; set model.name back, or start a new run_dir"
        )
    if saved["name"] != current["name"] and world.is_main:
        print(
            f"trainer: the base model was {saved['name']} when {path} was written, now {current['name']}: "
            "the same files (fingerprint), resuming",
            flush=True,
        )
