"""Read an offline W&B run back with wandb's own reader (`wandb leet inspect --json`, one JSON
line per record of the run's .wandb log), for the tests of tandem's W&B logging."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WANDB_HOMES = ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR")


def keep_wandb_home_in(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb's caches, staging and settings under `path` instead of the user's home."""
    for var in WANDB_HOMES:
        monkeypatch.setenv(var, str(path))


def offline_runs(run_dir: Path) -> list[Path]:
    """The offline runs under run_dir/wandb/, oldest first."""
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def records(offline_run: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_run)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def history(offline_run_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logged rows (wandb flattens a table's fields into `<key>.<field>`)."""
    return [r["history"]["item"] for r in offline_run_records if r["type"] == "history"]
