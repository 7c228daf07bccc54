"""The run's one Weights & Biases run, written by the orchestrator alone.

Every RL run has exactly one orchestrator (on one machine, under Slurm and on Kubernetes alike),
so it owns the W&B run; the trainer's numbers reach it through run_dir/metrics.jsonl, which the
trainer's rank 0 appends to anyway. The orchestrator forwards every record any process appends
there, its own included, as `<source>/<key>` plotted against `<source>/step` (W&B's
define_metric): the processes log their steps out of order relative to each other, and each
source keeps its own step axis. One writer means no shared-run handshake between processes, and
an offline run is one directory under run_dir/wandb/ that `wandb sync` uploads as it is.

Besides the metrics: the run's config (the whole resolved run, run_dir/configs/rl.toml, when the
launcher started the orchestrator and named it in TANDEM_RUN_CONFIG; else the orchestrator's
own), and every `sample_interval` steps a table of that step's rollouts.

A resumed run continues the same W&B run: run_dir/wandb/forwarded.json keeps the run id and how
many bytes of metrics.jsonl were forwarded, so no record is skipped. The offset saved lags one poll
behind the records handed to W&B (whose own process writes them a moment later) until the run
finishes: after a kill, a resume sends the last poll's records again rather than lose them. A line
that is not a record is skipped with a warning naming the file and line (the run goes on).
"""

import asyncio
import importlib.util
import json
import logging
import os
import time
import tomllib
from pathlib import Path
from typing import Any

from tandem.cli import UserError
from tandem.monitor.config import WandbConfig
from tandem.monitor.metrics import MetricsFileError, parse_line

log = logging.getLogger(__name__)
RUN_CONFIG_ENV = "TANDEM_RUN_CONFIG"
STATE_FILE = "forwarded.json"
NOT_METRICS = ("step", "source", "time", "repeated", "attempt")
"""Keys of a metrics.jsonl record that are not numbers to plot."""


def require_wandb() -> None:
    """One line when [monitor.wandb] is set but the package is missing."""
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(
            "[monitor.wandb] is set but the wandb package is not installed: `uv sync --extra wandb` "
            "(or `pip install wandb`), or remove the section / set monitor.wandb.mode = disabled"
        )


def run_config(fallback: dict[str, Any]) -> dict[str, Any]:
    """The config W&B records: the whole run's resolved file when the launcher named it."""
    path = os.environ.get(RUN_CONFIG_ENV)
    if path and Path(path).is_file():
        return tomllib.loads(Path(path).read_text())
    return fallback


class WandbRun:
    """Forwards run_dir/metrics.jsonl to one W&B run and logs rollout tables into it."""

    def __init__(
        self, cfg: WandbConfig, run_dir: Path, resume: bool, config: dict[str, Any], poll_s: float = 1.0
    ) -> None:
        require_wandb()
        import wandb

        self.cfg = cfg
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        self.state_path = Path(run_dir) / "wandb" / STATE_FILE
        self.poll_s = poll_s
        state = json.loads(self.state_path.read_text()) if resume and self.state_path.is_file() else {}
        self.offset: int = state.get("offset", 0)  # of metrics.jsonl handed to W&B
        self.saved: int = self.offset  # what forwarded.json says: one poll behind until finish()
        self.lines = self._lines_before(self.offset)
        self.last_step: dict[str, int] = {}
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or Path(run_dir).absolute().name,
                tags=cfg.tags,
                mode=cfg.mode,
                config=config,
                dir=run_dir,
                id=state.get("run_id"),
                resume="allow" if state else None,
            )
        except Exception as e:  # wandb raises its own error types for login and network problems
            raise UserError(
                f"monitor.wandb: W&B did not start the run ({type(e).__name__}: {e}); "
                "mode = offline logs without a network"
            ) from None
        self.sources: set[str] = set()
        self.save_state()
        log.info("W&B run %s (%s, project %s)", self.run.id, cfg.mode, cfg.project)

    def _lines_before(self, offset: int) -> int:
        """Lines in the first `offset` bytes of metrics.jsonl, to number the lines in warnings."""
        if offset == 0 or not self.metrics_path.is_file():
            return 0
        with self.metrics_path.open("rb") as f:
            return f.read(offset).count(b"\n")

    def save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": self.run.id, "offset": self.saved}))
        tmp.replace(self.state_path)

    def define(self, source: str) -> None:
        """`<source>/*` is plotted against `<source>/step` (once per source)."""
        if source not in self.sources:
            self.run.define_metric(f"{source}/step")
            self.run.define_metric(f"{source}/*", step_metric=f"{source}/step")
            self.sources.add(source)

    def log_record(self, record: dict[str, Any]) -> None:
        source = record.get("source", "run")
        self.define(source)
        values = {f"{source}/{k}": v for k, v in record.items() if k not in NOT_METRICS}
        self.run.log(values | {f"{source}/step": record["step"]})
        self.last_step[source] = max(self.last_step.get(source, -1), record["step"])

    def forward_new(self) -> None:
        """Forward the complete lines appended to metrics.jsonl since the last call."""
        if not self.metrics_path.is_file():
            return
        with self.metrics_path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        if end == 0:
            return
        for line in data[: end - 1].split(b"\n"):
            self.lines += 1
            try:
                record = parse_line(line, self.metrics_path, self.lines)
            except MetricsFileError as e:
                log.warning("W&B: skipped %s", e)
                continue
            if record is not None:
                self.log_record(record)
        self.saved, self.offset = self.offset, self.offset + end  # (the previous poll's are on disk)
        self.save_state()

    async def forward(self) -> None:
        """Forward new records every `poll_s` seconds until cancelled."""
        while True:
            self.forward_new()
            await asyncio.sleep(self.poll_s)

    async def wait_for(self, source: str, step: int, timeout_s: float) -> None:
        """Forward until a record of `source` for `step` arrived; after `timeout_s` warn and return
        (the run's training is done; only its W&B record would miss the last numbers)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.forward_new()
            if self.last_step.get(source, -1) >= step:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "W&B: no %s metrics for step %d in %s within %gs; the W&B run ends without them",
                    source,
                    step,
                    self.metrics_path,
                    timeout_s,
                )
                return
            await asyncio.sleep(self.poll_s)

    def samples_due(self, step: int) -> bool:
        return self.cfg.sample_interval > 0 and step % self.cfg.sample_interval == 0

    def log_table(self, key: str, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of `rows` (dicts with the same keys) under `orchestrator/<key>` at `step`."""
        import wandb

        if not rows:
            return
        columns = list(rows[0])
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self.define("orchestrator")
        self.run.log({f"orchestrator/{key}": table, "orchestrator/step": step})

    def finish(self, failed: bool) -> None:
        self.forward_new()
        self.run.finish(exit_code=1 if failed else 0)  # (returns once W&B has written everything)
        self.saved = self.offset
        self.save_state()
