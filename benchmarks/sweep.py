"""Run variants of one training command side by side and print their eval curves as a table.

    python benchmarks/sweep.py --out runs/sweep \
        --command "python -m tandem.trainer.sft.cli @ examples/reverse_text/sft.toml --eval.interval 50" \
        --variant base= --variant lr4e-3="--optim.lr 4e-3"

    python benchmarks/sweep.py --out runs/rl-sweep --metric eval/reward_mean \
        --metric2 eval/env/exact_match \
        --command "python -m tandem.launch.cli @ examples/reverse_text/rl.toml --inference.port {port}" \
        --variant lr1e-4="--trainer.optim.lr 1e-4" --variant lr3e-4="--trainer.optim.lr 3e-4"

Each variant is `name=extra CLI overrides`, appended to the command together with
`--run-dir OUT/name`; `{port}` in the command becomes a port of its own per variant. Variants run
as parallel processes spread over the visible GPUs (one GPU each, through CUDA_VISIBLE_DEVICES), or
on the CPU when there are none. Learning speed per step can so be compared on a fast machine before
the winner is timed where it must run (the 2-core CPU examples).
"""

import argparse
import json
import os
import shlex
import subprocess
import time
from pathlib import Path


def launch(index: int, name: str, extra: str, args: argparse.Namespace, gpu: str | None) -> subprocess.Popen:
    run_dir = Path(args.out) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    command = args.command.replace("{port}", str(args.base_port + 10 * index))
    cmd = [*shlex.split(command), "--run-dir", str(run_dir), *shlex.split(extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    with open(Path(args.out) / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def curve(run_dir: Path, metric: str, metric2: str | None) -> dict[int, tuple[float, float | None]]:
    points = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if metric in row:
                points[row["step"]] = (row[metric], row.get(metric2) if metric2 else None)
    return points


def cell(point: tuple[float, float | None] | None) -> str:
    if point is None:
        return ""
    first, second = point
    return f"{first:.2f}" + (f"/{second:.2f}" if second is not None else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--command", required=True, help="The training command, without --run-dir.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", action="append", required=True, help="name=overrides")
    parser.add_argument("--metric", default="eval/reward")
    parser.add_argument("--metric2", default="eval/exact_match", help="Shown after a slash; '' for none.")
    parser.add_argument("--parallel", type=int, default=8, help="Variants running at once.")
    parser.add_argument("--base-port", type=int, default=8100)
    args = parser.parse_args()

    import torch

    gpus = [str(i) for i in range(torch.cuda.device_count())] or [None]
    variants = [v.split("=", 1) for v in args.variant]
    procs: dict[str, subprocess.Popen] = {}
    start = time.monotonic()
    for i, (name, extra) in enumerate(variants):
        while sum(p.poll() is None for p in procs.values()) >= args.parallel:
            time.sleep(1)
        procs[name] = launch(i, name, extra, args, gpus[i % len(gpus)])
    codes = {name: proc.wait() for name, proc in procs.items()}
    print(f"# {len(variants)} variants in {time.monotonic() - start:.0f}s: {args.command}")
    curves = {name: curve(Path(args.out) / name, args.metric, args.metric2 or None) for name, _ in variants}
    steps = sorted({s for c in curves.values() for s in c})
    print("| variant | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for name, _ in variants:
        print(f"| {name} | " + " | ".join(cell(curves[name].get(s)) for s in steps) + " |")
    print(f"cells: {args.metric}" + (f" / {args.metric2}" if args.metric2 else ""))
    for name, extra in variants:
        print(f"{name}: {extra}" + (f"  (exit {codes[name]})" if codes.get(name) else ""))


if __name__ == "__main__":
    main()
