"""`uv run plot RUN_DIR`: draw a run's reward curve into RUN_DIR/reward.png.

Reads RUN_DIR/metrics.jsonl and plots, against the trainer step: the orchestrator's mean reward
of the training rollouts and the held-out evaluation reward (and exact match where the
environment logs it), on an axis from 0 (or the lowest reward) to the highest reward (Wordle's
reach 2). Several runs can be overlaid: `uv run plot RUN_A RUN_B --out compare.png`.
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

from tandem.cli import UserError, run_cli  # noqa: E402
from tandem.monitor.metrics import read_metrics  # noqa: E402


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """`key`'s values by step, in step order; of a step logged twice, the later record's value."""
    points = {r["step"]: r[key] for r in records if r.get(key) is not None}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for run_dir in run_dirs:
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            raise UserError(f"no metrics file at {path}")
        records = read_metrics(path, source="orchestrator", latest=True)
        label = run_dir.name if len(run_dirs) > 1 else ""
        steps, rewards = series(records, "reward_mean")
        (line,) = ax.plot(steps, rewards, alpha=0.5, label=f"{label} train reward".strip())
        steps, rewards = series(records, "eval/reward_mean")
        ax.plot(steps, rewards, "o-", color=line.get_color(), label=f"{label} held-out reward".strip())
        steps, exact = series(records, "eval/env/exact_match")
        if exact:
            ax.plot(
                steps,
                exact,
                "s--",
                color=line.get_color(),
                alpha=0.6,
                label=f"{label} held-out exact".strip(),
            )
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylabel("reward")
    low, high = ax.get_ylim()  # (matplotlib's fit of every line drawn)
    ax.set_ylim(min(0.0, low), max(1.02, high))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("reward" if len(run_dirs) > 1 else f"reward — {run_dirs[0]}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> None:
    def run() -> None:
        parser = argparse.ArgumentParser(prog="plot", description=__doc__.splitlines()[0])
        parser.add_argument("run_dirs", type=Path, nargs="+", help="run directories with metrics.jsonl")
        parser.add_argument("--out", type=Path, help="PNG to write (default: RUN_DIR/reward.png)")
        args = parser.parse_args()
        out = plot_runs(args.run_dirs, args.out or args.run_dirs[0] / "reward.png")
        print(f"wrote {out}")

    run_cli(run, "plot")


if __name__ == "__main__":
    main()
