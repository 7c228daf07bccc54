"""Where the time of an RL run goes, from its metrics: a table per run of step time and waits.

    python benchmarks/rl_timing.py RUN_DIR [RUN_DIR ...] [--skip 5]

Per run: the median seconds between trainer steps, then (medians over steps) the trainer's
compute, its wait for rollouts and its weight publish, and the orchestrator's rollout generation
and its wait for weights; the share of wall time each side spent waiting; and the held-out reward
at every evaluation. The first `--skip` steps (start-up, compilation, warm-up) are left out of
the medians.
"""

import argparse
import statistics
from pathlib import Path

from tandem.monitor.metrics import read_metrics


def median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def idle_percent(records: list[dict], key: str) -> float:
    """Share of the wall time between the first and last record spent in `key` (a wait)."""
    wall = records[-1]["time"] - records[0]["time"]
    return 100 * sum(r.get(key) or 0.0 for r in records[1:]) / wall if wall > 0 else float("nan")


def summarize(run_dir: Path, skip: int) -> dict[str, float | str]:
    records = read_metrics(run_dir / "metrics.jsonl")
    trainer = [r for r in records if r["source"] == "trainer" and r["step"] >= skip]
    orchestrator = [
        r for r in records if r["source"] == "orchestrator" and "rollout_s" in r and r["step"] >= skip
    ]
    if len(trainer) < 2:
        raise SystemExit(f"{run_dir}: fewer than 2 trainer steps after step {skip}")
    times = [r["time"] for r in trainer]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    evals = [r for r in records if "eval/reward_mean" in r]
    return {
        "run": run_dir.name,
        "steps": len(trainer),
        "s/step": statistics.median(gaps),
        "trainer compute": median(trainer, "compute_s"),
        "trainer wait": median(trainer, "rollout_wait_s"),
        "publish": median(trainer, "publish_s"),
        "rollouts": median(orchestrator, "rollout_s"),
        "orch wait": median(orchestrator, "wait_weights_s"),
        "trainer idle %": idle_percent(trainer, "rollout_wait_s"),
        "orch idle %": idle_percent(orchestrator, "wait_weights_s"),
        "eval": " ".join(f"{r['step']}:{r['eval/reward_mean']:.3f}" for r in evals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--skip", type=int, default=5, help="Leading steps left out of the medians.")
    args = parser.parse_args()
    rows = [summarize(d, args.skip) for d in args.run_dirs]
    columns = [c for c in rows[0] if c != "eval"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for k, v in row.items() if k != "eval"]
        print("| " + " | ".join(cells) + " |")
    print("\nheld-out reward (step:reward)")
    for row in rows:
        print(f"{row['run']}: {row['eval']}")


if __name__ == "__main__":
    main()
