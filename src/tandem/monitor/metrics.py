"""Append-only metrics log: one JSON object per line in `run_dir/metrics.jsonl`.

Used by every process that reports numbers (trainers, orchestrator). Each record carries the
`step` it belongs to, a `source` naming the writer, and the wall-clock `time`; lines are flushed
as written so a crashed run keeps everything logged before the crash. Only the writer that owns
the file should be enabled (rank 0 of a trainer); disabled writers accept calls and do nothing.

A resumed run appends to the same file and may log steps its source logged before (the steps
after the last checkpoint are trained again). Those records carry `repeated: true` and
`attempt: N` (2 for the first resume, ...); earlier records stay as they were.
`read_metrics(..., latest=True)` keeps, per source and step, only the last attempt's records.
"""

import json
import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO


class MetricsWriter:
    def __init__(self, path: Path, source: str, enabled: bool = True) -> None:
        self.path = Path(path)
        self.source = source
        self.enabled = enabled
        self._file: TextIO | None = None
        self._logged_up_to = -1
        self._attempt = 1
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            earlier = read_metrics(self.path, source) if self.path.is_file() else []
            if earlier:
                self._logged_up_to = max(r["step"] for r in earlier)
                self._attempt = max(r.get("attempt", 1) for r in earlier) + 1
            self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, **values: Any) -> None:
        """Append one record; non-finite floats are written as null (JSON has no NaN)."""
        if self._file is None:
            return
        record = {"step": step, "source": self.source, "time": round(time.time(), 3)}
        if step <= self._logged_up_to:
            record |= {"repeated": True, "attempt": self._attempt}
        record.update({k: _jsonable(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: Path, source: str | None = None, latest: bool = False) -> list[dict[str, Any]]:
    """All records of a metrics file (optionally of one source), in the order written; `latest`:
    for each (source, step), only the records of its last attempt."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    records = [r for r in records if source is None or r.get("source") == source]
    if not latest:
        return records
    last: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r.get("source", ""), r["step"])
        last[key] = max(last.get(key, 1), r.get("attempt", 1))
    return [r for r in records if r.get("attempt", 1) == last[(r.get("source", ""), r["step"])]]
