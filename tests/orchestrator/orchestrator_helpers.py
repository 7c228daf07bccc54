"""Helpers shared by the orchestrator tests: the stand-in trainer's weight publishing and polling."""

import asyncio
import shutil
import time
from pathlib import Path

import httpx


def served_version(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["weight_version"]


def publish_weights(model: Path, run_dir: Path, version: int, stable: bool = True) -> Path:
    """weights/step_N/ as the trainer writes it: files under a temporary name, renamed, STABLE last."""
    target = run_dir / "weights" / f"step_{version}"
    if not target.exists():
        tmp = run_dir / "weights" / f".step_{version}.tmp"
        shutil.copytree(model, tmp)
        tmp.rename(target)
    if stable:
        (target / "STABLE").write_text("")
    return target


async def wait_for_file(path: Path, timeout_s: float = 60.0) -> float:
    """Poll until `path` exists; returns the monotonic time it was seen."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g}s")
        await asyncio.sleep(0.02)
    return time.monotonic()


def serve_base_model(url: str, model: Path, scratch: Path) -> None:
    """Put the server back on the initial model (version 0), whatever earlier tests loaded."""
    path = publish_weights(model, scratch, 0)
    response = httpx.post(url + "/update_weights", json={"path": str(path)}, timeout=60)
    assert response.json()["weight_version"] == 0, response.text
