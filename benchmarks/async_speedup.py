"""Wall time to a held-out reward, synchronous against asynchronous RL (what tandem exists for).

    python benchmarks/async_speedup.py --out runs/async -- uv run rl @ examples/reverse_text/rl.toml
    python benchmarks/async_speedup.py --out runs/async --levels 0,1,2 --target 0.7 -- COMMAND ...
    python benchmarks/async_speedup.py --out runs/async --report      # the table of finished runs

Runs the RL command once per `--levels` value (default 0 and 2), appending
`--orchestrator.max-async-level L --run-dir OUT/async_L`, one after another so that each run has
the machine to itself; then reads each run's held-out evaluations (metrics.jsonl:
`eval/reward_mean` and the record's time) and prints, per level, the wall time from the run's
step-0 evaluation (start-up and model loading are left out: they do not depend on the level) to
its first evaluation at or above the target reward, its seconds per trainer step, and its last
reward. The target is `--target`, else the lowest last reward among the runs (the reward all of
them reach). Speed-up = the first level's time / each level's time. A run that never reaches the
target shows "not reached", and the table says so instead of a speed-up.
"""

import argparse
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tandem.monitor.metrics import read_metrics  # noqa: E402

METRIC = "eval/reward_mean"


def run_dir(out: Path, level: int) -> Path:
    return out / f"async_{level}"


def evaluations(path: Path) -> list[tuple[float, int, float]]:
    """(time, step, reward) of each held-out evaluation of the run in `path`, in order."""
    records = read_metrics(path / "metrics.jsonl")
    return sorted((r["time"], r["step"], r[METRIC]) for r in records if r.get(METRIC) is not None)


def step_seconds(path: Path) -> float:
    """Median seconds between the trainer's consecutive step records."""
    times = sorted(r["time"] for r in read_metrics(path / "metrics.jsonl", source="trainer", latest=True))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")


def time_to(evals: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """Seconds from the first evaluation to the first at or above `target`, and its step."""
    start = evals[0][0]
    for time, step, reward in evals:
        if reward >= target:
            return time - start, step
    return None


def report(out: Path, levels: list[int], target: float | None) -> None:
    runs = {level: evaluations(run_dir(out, level)) for level in levels}
    missing = [level for level, evals in runs.items() if len(evals) < 2]
    if missing:
        raise SystemExit(
            f"no held-out evaluations ({METRIC}) in {', '.join(str(run_dir(out, m)) for m in missing)}"
        )
    goal = target if target is not None else min(evals[-1][2] for evals in runs.values())
    reached = {level: time_to(evals, goal) for level, evals in runs.items()}
    print(f"\nheld-out reward target {goal:.4f} ({'given' if target is not None else 'lowest last reward'})")
    print(
        f"{'max_async_level':>15} {'s to target':>12} {'at step':>8} {'s / step':>9} {'last reward':>12} {'speed-up':>9}"
    )
    base = reached[levels[0]]
    for level in levels:
        hit, evals = reached[level], runs[level]
        seconds = f"{hit[0]:12.1f} {hit[1]:8d}" if hit else f"{'not reached':>12} {'-':>8}"
        speedup = f"{base[0] / hit[0]:8.2f}x" if hit and base and hit[0] > 0 else f"{'-':>9}"
        print(
            f"{level:15d} {seconds} {step_seconds(run_dir(out, level)):9.2f} {evals[-1][2]:12.4f} {speedup}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="one run directory per level goes here")
    parser.add_argument("--levels", default="0,2", help="max_async_level values, the baseline first")
    parser.add_argument(
        "--target", type=float, help="held-out reward to reach (default: the lowest last reward)"
    )
    parser.add_argument("--report", action="store_true", help="only print the table of finished runs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the RL command, after --")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.report:
        if not command:
            parser.error("give the RL command after --, e.g. -- uv run rl @ examples/reverse_text/rl.toml")
        for level in levels:
            extra = ["--orchestrator.max-async-level", str(level), "--run-dir", str(run_dir(args.out, level))]
            print(f"== max_async_level {level}: {shlex.join(command + extra)}", flush=True)
            done = subprocess.run(command + extra, check=False)
            if done.returncode != 0:
                raise SystemExit(f"the run at max_async_level {level} failed (exit {done.returncode})")
    report(args.out, levels, args.target)


if __name__ == "__main__":
    main()
