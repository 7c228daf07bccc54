"""The reverse-text task: reverse 4–16 random lowercase letters.

The prompt is one user message, `Reverse the following text: <text>`; the answer is the reversed
text and nothing else. This exact format is shared by the SFT example, the RL environment and
external evaluators: do not change it.
"""

import difflib
import random
import string
from dataclasses import dataclass
from typing import Literal

PROMPT_PREFIX = "Reverse the following text: "
MIN_LEN, MAX_LEN = 4, 16
Split = Literal["train", "eval"]


@dataclass(frozen=True)
class ReverseTextTask:
    task_id: str
    text: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": PROMPT_PREFIX + self.text}]

    @property
    def answer(self) -> str:
        return self.text[::-1]


def is_eval_text(text: str) -> bool:
    """Held-out split by content hash: a text is in exactly one split, whatever the seed."""
    return sum(ord(c) * 31**i for i, c in enumerate(text)) % 10 == 0


def make_tasks(
    split: Split, count: int, seed: int = 0, min_len: int = MIN_LEN, max_len: int = MAX_LEN
) -> list[ReverseTextTask]:
    """`count` tasks of the split, reproducible from `seed`; lengths uniform in [min_len, max_len]."""
    if not MIN_LEN <= min_len <= max_len <= MAX_LEN:
        raise ValueError(f"lengths must satisfy {MIN_LEN} <= min_len <= max_len <= {MAX_LEN}")
    rng = random.Random(f"reverse_text/{split}/{seed}")
    tasks = []
    while len(tasks) < count:
        text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
        if is_eval_text(text) == (split == "eval"):
            tasks.append(ReverseTextTask(task_id=f"{split}-{seed}-{len(tasks)}", text=text))
    return tasks


def reward(completion: str, task: ReverseTextTask) -> float:
    """Character-level similarity in [0, 1] of the answer to the true reverse; exact match is 1."""
    answer = completion.strip()
    if answer == task.answer:
        return 1.0
    return difflib.SequenceMatcher(None, answer, task.answer, autojunk=False).ratio()
