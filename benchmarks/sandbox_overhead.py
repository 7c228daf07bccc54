"""Per-program overhead of the code sandbox: a trivial program (`pass`) in each isolation mode this
machine has, against the same interpreter started plainly, one program at a time.

    uv run python benchmarks/sandbox_overhead.py [--runs 30]

Prints median and 90th percentile wall time per program (start to exit, output collected) and the
sandbox's overhead (median minus the plain start's median). The target is < 0.3 s.
"""

import argparse
import asyncio
import statistics
import sys
import time

from tandem.envs.sandbox import Limits, Sandbox, isolation_status


async def plain(source: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-B", "-c", source, stdout=asyncio.subprocess.PIPE
    )
    await process.communicate()


def measure(run, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        asyncio.run(run())
        times.append(time.perf_counter() - start)
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    source = "pass"
    rows = [("plain python -I -S", measure(lambda: plain(source), args.runs))]
    modes = [m for m, why in isolation_status().items() if why is None] + ["unsafe-local"]
    for mode in modes:
        sandbox = Sandbox(Limits(), isolation=mode)
        rows.append((mode, measure(lambda s=sandbox: s.run(source), args.runs)))
    base = statistics.median(rows[0][1])
    print("| mode | median s | p90 s | overhead s (median − plain) |\n|---|---|---|---|")
    for name, times in rows:
        median, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        print(f"| {name} | {median:.3f} | {p90:.3f} | {median - base:+.3f} |")
    for mode, why in isolation_status().items():
        if why is not None:
            print(f"({mode} unavailable here: {why})")


if __name__ == "__main__":
    main()
