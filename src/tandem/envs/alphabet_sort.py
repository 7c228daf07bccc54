"""Alphabet sort: names arrive over several turns; each turn the model lists all names so far in
alphabetical order, separated by commas.

    user:      Sort these names alphabetically: Maya, Ben ...
    assistant: Ben, Maya
    user:      More names: Ada. Sort all names so far.
    assistant: Ada, Ben, Maya

Reward = the mean over the task's turns of that turn's score: 1 for the exact list, else the
similarity of the answered list to the right one (difflib ratio over names); a turn the model
never reached scores 0. `exact_turns` (weight 0) is the fraction of turns answered exactly;
`solved` (weight 0, the success that `evaluate` counts for pass@k) is 1 when every turn was.
The train and eval splits divide tasks by a hash of their names.
"""

import difflib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from tandem.envs.base import Message, RewardFunction, Split
from tandem.envs.multi_turn import MultiTurnEnv

NAMES = [
    "Ada",
    "Alan",
    "Alice",
    "Amir",
    "Anna",
    "Aria",
    "Ben",
    "Bruno",
    "Carl",
    "Clara",
    "Dana",
    "David",
    "Eli",
    "Emma",
    "Eva",
    "Felix",
    "Fiona",
    "Grace",
    "Hana",
    "Hugo",
    "Ian",
    "Ida",
    "Iris",
    "Ivan",
    "Jack",
    "Jade",
    "Jonas",
    "Kai",
    "Kate",
    "Leo",
    "Lena",
    "Liam",
    "Lina",
    "Luca",
    "Maya",
    "Max",
    "Mia",
    "Nadia",
    "Noah",
    "Nora",
    "Olga",
    "Omar",
    "Oscar",
    "Paul",
    "Petra",
    "Quinn",
    "Rosa",
    "Ruth",
    "Sam",
    "Sara",
    "Theo",
    "Tina",
    "Uma",
    "Vera",
    "Victor",
    "Wade",
    "Yara",
    "Yusuf",
    "Zane",
    "Zoe",
]


@dataclass(frozen=True)
class SortTask:
    task_id: str
    batches: tuple[tuple[str, ...], ...]
    """The names revealed in each turn."""

    def expected(self, turn: int) -> list[str]:
        """The right answer of turn `turn` (0-based): every name revealed so far, sorted."""
        return sorted(name for batch in self.batches[: turn + 1] for name in batch)


def is_eval(names: Sequence[str]) -> bool:
    return sum(ord(c) * 31**i for i, c in enumerate("".join(names))) % 10 == 0


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.strip().rstrip(".").split(",") if part.strip()]


def turn_scores(task: SortTask, messages: list[Message]) -> list[float]:
    """One score per turn of the task (0 for turns without an answer)."""
    answers = [parse_list(m.get("content") or "") for m in messages if m.get("role") == "assistant"]
    scores = []
    for turn in range(len(task.batches)):
        expected = task.expected(turn)
        if turn >= len(answers):
            scores.append(0.0)
        elif answers[turn] == expected:
            scores.append(1.0)
        else:
            scores.append(difflib.SequenceMatcher(None, answers[turn], expected, autojunk=False).ratio())
    return scores


def sorted_score(task: SortTask, messages: list[Message]) -> float:
    scores = turn_scores(task, messages)
    return sum(scores) / len(scores)


def exact_turns(task: SortTask, messages: list[Message]) -> float:
    scores = turn_scores(task, messages)
    return sum(s == 1.0 for s in scores) / len(scores)


def solved(task: SortTask, messages: list[Message]) -> float:
    return float(exact_turns(task, messages) == 1.0)


class AlphabetSortEnv(MultiTurnEnv):
    name = "alphabet_sort"
    success_metric = "solved"

    class Args(MultiTurnEnv.Args):
        max_turns: int = Field(4, gt=0, description="Most turns of a task (tasks have min_turns..max_turns).")
        min_turns: int = Field(2, gt=0, description="Fewest turns of a task.")
        max_names_per_turn: int = Field(3, gt=0, description="Names revealed per turn: 1..this many.")
        num_train_tasks: int = Field(10_000, gt=0, description="Size of the training split.")
        num_eval_tasks: int = Field(200, gt=0, description="Size of the held-out split.")
        data_seed: int = Field(0, description="Seed of the task generator.")

        @model_validator(mode="after")
        def check_turns(self) -> "AlphabetSortEnv.Args":
            if self.min_turns > self.max_turns:
                raise PydanticCustomError(
                    "turns", f"min_turns ({self.min_turns}) exceeds max_turns ({self.max_turns})"
                )
            if self.max_turns * self.max_names_per_turn > len(NAMES):
                raise PydanticCustomError(
                    "turns", f"max_turns × max_names_per_turn exceeds the {len(NAMES)} names available"
                )
            return self

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [
            RewardFunction("sorted", sorted_score, 1.0),
            RewardFunction("exact_turns", exact_turns, 0.0),
            RewardFunction("solved", solved, 0.0),
        ]

    def __init__(self, args: Args | None = None) -> None:
        super().__init__(args)
        self.splits: dict[str, list[SortTask]] = {}

    def dataset(self, split: Split) -> Sequence[SortTask]:
        if split not in self.splits:
            self.splits[split] = self.make_tasks(split)
        return self.splits[split]

    def make_tasks(self, split: Split) -> list[SortTask]:
        a = self.args
        count = a.num_train_tasks if split == "train" else a.num_eval_tasks
        rng = random.Random(f"alphabet_sort/{split}/{a.data_seed}")
        tasks: list[SortTask] = []
        while len(tasks) < count:
            turns = rng.randint(a.min_turns, a.max_turns)
            sizes = [rng.randint(1, a.max_names_per_turn) for _ in range(turns)]
            names = rng.sample(NAMES, sum(sizes))
            if is_eval(names) != (split == "eval"):
                continue
            batches, start = [], 0
            for size in sizes:
                batches.append(tuple(names[start : start + size]))
                start += size
            tasks.append(SortTask(f"alphabet_sort-{split}-{a.data_seed}-{len(tasks)}", tuple(batches)))
        return tasks

    def prompt(self, task: SortTask) -> list[Message]:
        return [
            {
                "role": "user",
                "content": "Sort these names alphabetically: "
                + ", ".join(task.batches[0])
                + "\nAnswer with the names separated by commas. More names may follow; then answer "
                "with all names so far.",
            }
        ]

    async def env_response(self, task: SortTask, messages: list[Message]) -> list[Message] | None:
        turn = sum(m.get("role") == "assistant" for m in messages)
        if turn >= len(task.batches):
            return None
        return [
            {
                "role": "user",
                "content": f"More names: {', '.join(task.batches[turn])}. Sort all names so far.",
            }
        ]
