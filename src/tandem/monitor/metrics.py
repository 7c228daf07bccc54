"""Append-only metrics log: one JSON object per line in `run_dir/metrics.jsonl`.

Used by every process that reports numbers (trainers, orchestrator). Each record carries the
`step` it belongs to, a `source` naming the writer, and the wall-clock `time`; lines are flushed
as written so a crashed run keeps everything logged before the crash. Only the writer that owns
the file should be enabled (rank 0 of a trainer); disabled writers accept calls and do nothing.

A resumed run appends to the same file and may log steps its source logged before (the steps
after the last checkpoint are trained again). Those records carry `repeated: true` and
`attempt: N` (2 for the first resume, ...); earlier records stay as they were.
`read_metrics(..., latest=True)` keeps, per source and step, only the last attempt's records.

A writer killed mid-write can leave a last line without its newline: readers ignore it, and the
next writer to open the file cuts it off before appending. Any other line that is not a record
(a JSON object with an integer `step`) is skipped with a warning naming the file and line, so
that such a line (another writer's, torn while this one appended) never stops a resume.
"""

import json
import logging
import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

log = logging.getLogger("tandem.monitor")


class MetricsFileError(ValueError):
    """A line of a metrics file that is not a record (the readers skip it with a warning)."""


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
            if self.path.is_file():
                _cut_torn_tail(self.path)
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


def parse_line(line: bytes, path: Path, number: int) -> dict[str, Any] | None:
    """The record on line `number` of `path`, None for a blank line; MetricsFileError otherwise."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as e:
        raise MetricsFileError(f"{path}:{number}: not JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise MetricsFileError(f"{path}:{number}: not a metrics record (a JSON object with an integer step)")
    return record


def _is_torn(tail: bytes, path: Path, number: int) -> bool:
    """Whether `tail`, the text after the file's last newline, is a partly written record (a
    complete record that only lacks its newline is kept)."""
    try:
        return parse_line(tail, path, number) is None and bool(tail)
    except MetricsFileError:
        return True


def _cut_torn_tail(path: Path) -> None:
    """Remove a partly written last line, or end a complete one, so the next record starts a line.

    Run once when a writer opens the file; other writers append whole lines in one write, so
    they do not race with this in practice."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    if _is_torn(data[start:], path, data.count(b"\n") + 1):
        os.truncate(path, start)
    else:
        with path.open("ab") as f:
            f.write(b"\n")


def read_metrics(path: Path, source: str | None = None, latest: bool = False) -> list[dict[str, Any]]:
    """All records of a metrics file (optionally of one source), in the order written; `latest`:
    for each (source, step), only the records of its last attempt.

    A torn last line (no newline, not a whole record) is ignored; any other bad line is skipped
    with a warning naming the file and line."""
    path = Path(path)
    *lines, tail = path.read_bytes().split(b"\n")
    if not _is_torn(tail, path, len(lines) + 1):
        lines.append(tail)
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = parse_line(line, path, number)
        except MetricsFileError as e:
            log.warning("skipped %s", e)
            continue
        if record is not None:
            records.append(record)
    records = [r for r in records if source is None or r.get("source") == source]
    if not latest:
        return records
    last: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r.get("source", ""), r["step"])
        last[key] = max(last.get(key, 1), r.get("attempt", 1))
    return [r for r in records if r.get("attempt", 1) == last[(r.get("source", ""), r["step"])]]
