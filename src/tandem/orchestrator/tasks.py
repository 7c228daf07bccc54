"""Which training tasks a step uses: a function of (seed, step) only, so a resumed run draws the
same tasks as an uninterrupted one, however many prompts earlier steps consumed."""

import random
from collections.abc import Iterator


def step_task_order(num_tasks: int, seed: int, step: int, stream: str = "") -> Iterator[int]:
    """Dataset indices for `step`: a fresh shuffle of all tasks, reshuffled whenever exhausted.
    `stream` separates the orders of several environments mixed in one run."""
    if num_tasks <= 0:
        raise ValueError("the training split is empty")
    key = f"tandem/task-order/{seed}/{step}" + (f"/{stream}" if stream else "")
    rng = random.Random(key)
    while True:
        order = list(range(num_tasks))
        rng.shuffle(order)
        yield from order
