"""The order files are handed out in under `pytest -n 2 --dist loadfile` (.ci/run, README).

xdist hands out files in descending order of their test count, which puts the long files of few
tests (whole RL runs on CPU, a Slurm job, torchrun on two nodes) last: one worker then runs them
alone after the other has finished. Files marked `slow` go first here; the rest keep xdist's
order (most tests first)."""

from collections import Counter

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # (xdist installed)
        config.option.loadscopereorder = False  # the order below replaces xdist's


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    files = Counter(item.nodeid.split("::")[0] for item in items)
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def order(item: pytest.Item) -> tuple[bool, int]:
        file = item.nodeid.split("::")[0]
        return file not in slow, -files[file]

    items.sort(key=order)  # stable: each file's tests keep their order
