"""Published weights on disk: the trainer writes them, inference servers load them.

    run_dir/weights/step_N/           a Hugging Face model (safetensors, config, tokenizer)
    run_dir/weights/step_N/STABLE     written last: {"version": N}
    run_dir/weights/OFFERED           {"version": N}: the newest version the trainer offers over an
                                      in-memory transport (broadcast, colocated); the orchestrator
                                      then has the servers receive it (docs/weights.md)

`step_N` holds policy version N, the weights after N optimizer steps. Version 0 is the
configured base model itself and is not published. The directory is written under a temporary
name and renamed into place; STABLE is added after the rename, so a reader that sees STABLE sees
a complete model. Old versions are pruned STABLE-first for the same reason. A version is published
once (transport/layout.py says why a server must never see one rewritten); publishing a version
that exists (a trainer resumed without the `rl` launcher, which deletes those first) unlinks its
STABLE first and swaps the directory, so no reader that looks afterwards takes it half-written.
"""

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the readers (orchestrator, servers) need not import torch for these
    from torch import nn
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from tandem.trainer.parallel import World

STABLE = "STABLE"
OFFERED = "OFFERED"
STEP_DIR = re.compile(r"^step_(\d+)$")


def weights_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"step_{version}"


def stable_versions(run_dir: Path) -> list[int]:
    """Versions with a STABLE marker, oldest first."""
    root = Path(run_dir) / "weights"
    if not root.is_dir():
        return []
    found = [
        int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / STABLE).is_file()
    ]
    return sorted(found)


def latest_version(run_dir: Path) -> int | None:
    versions = stable_versions(run_dir)
    return versions[-1] if versions else None


def wait_for_version(run_dir: Path, version: int, timeout_s: float, poll_s: float = 0.05) -> Path:
    """Wait until weights/step_{version} is STABLE; returns the directory."""
    path = weights_dir(run_dir, version)
    deadline = time.monotonic() + timeout_s
    while not (path / STABLE).is_file():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {path / STABLE}")
        time.sleep(poll_s)
    return path


def offer_path(run_dir: Path) -> Path:
    return Path(run_dir) / "weights" / OFFERED


def write_offer(run_dir: Path, version: int) -> None:
    path = offer_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{OFFERED}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"version": version}))
    tmp.replace(path)


def offered_version(run_dir: Path) -> int | None:
    """The newest version offered in memory, or None (nothing offered yet)."""
    try:
        return int(json.loads(offer_path(run_dir).read_text())["version"])
    except (FileNotFoundError, ValueError, KeyError):
        return None


def clear_offer(run_dir: Path) -> None:
    """Forget an earlier run's offer: a resumed run's trainer starts a new weight link."""
    offer_path(run_dir).unlink(missing_ok=True)


def publish_weights(
    model: "nn.Module",
    tokenizer: "PreTrainedTokenizerBase",
    run_dir: Path,
    version: int,
    world: "World",
    keep: int = 0,
) -> Path:
    """Gather the full weights and publish them as `weights/step_{version}` (collective).

    `keep` > 0 deletes all but the newest `keep` published versions afterwards.
    """
    from tandem.trainer.hf_export import write_hf_model

    out = weights_dir(run_dir, version)
    if world.is_main and (out / STABLE).exists():
        (out / STABLE).unlink()  # republishing after a resume: never show STABLE on a directory in flux
    write_hf_model(model, tokenizer, out, world)
    if world.is_main:
        tmp = out / f".{STABLE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"version": version}))
        tmp.replace(out / STABLE)
        if keep > 0:
            for old in stable_versions(run_dir)[:-keep]:
                remove_weights(run_dir, old)
    return out


def remove_weights(run_dir: Path, version: int) -> None:
    """Delete weights/step_{version}, STABLE first, so that no reader ever sees a marked, partial directory."""
    (weights_dir(run_dir, version) / STABLE).unlink(missing_ok=True)
    shutil.rmtree(weights_dir(run_dir, version), ignore_errors=True)
