"""Training progress for people: a live rich bar on a terminal, plain lines in log files.

On rank 0 with a TTY the bar shows steps done/max_steps, loss, tokens/s and ETA. Without a TTY
(redirected to a log, under a launcher) a plain line is printed every `log_interval` steps and at
the last step instead, so logs stay readable. Other ranks print nothing.

A line names its step as the process's metrics.jsonl records do. The RL trainer and orchestrator
number steps from 0 (the `step` of their records, rollouts/step_N, their messages), so their
line is `step 9 (10/10)`: step 9, the tenth of ten, done (the checkpoint and weights after it are
step_10: named by steps done). SFT's records count steps done, and its line is `step 10/10`.
"""

import sys
import time
from types import TracebackType
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainingProgress:
    def __init__(
        self,
        total: int,
        start: int = 0,
        log_interval: int = 10,
        enabled: bool = True,
        index_steps: bool = False,
    ) -> None:
        """`index_steps`: the lines name each step by its index from 0, then the count done."""
        self.total = total
        self.index_steps = index_steps
        self.log_interval = max(1, log_interval)
        self.enabled = enabled
        self._start_step = start
        self._start_time = time.monotonic()
        self._bar: Progress | None = None
        if enabled and sys.stdout.isatty():
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task("train", total=total, completed=start, stats="")
            self._bar.start()

    def update(self, step: int, stats: dict[str, Any]) -> None:
        """Report that `step` steps are done (with index_steps: the one of index step - 1 last),
        with the numbers to show (floats are formatted)."""
        if not self.enabled:
            return
        text = "  ".join(f"{k} {_fmt(v)}" for k, v in stats.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=text)
        elif step % self.log_interval == 0 or step == self.total:
            done = f"{step - 1} ({step}/{self.total})" if self.index_steps else f"{step}/{self.total}"
            print(f"step {done}  {text}  eta {self._eta(step)}", flush=True)

    def _eta(self, step: int) -> str:
        done = step - self._start_step
        if done <= 0:
            return "?"
        seconds = (time.monotonic() - self._start_time) / done * (self.total - step)
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "TrainingProgress":
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)
