"""The reverse-text RL environment: single turn, rewarded by similarity to the reversed text.

Tasks, prompt format and reward come from `tandem.envs.reverse_text` (shared with SFT and eval).
"""

from collections.abc import Sequence

from pydantic import Field

from tandem.config.base import Section
from tandem.envs import reverse_text
from tandem.envs.base import Message, RewardFunction, SingleTurnEnv, Split, last_content
from tandem.envs.reverse_text import ReverseTextTask


def similarity(task: ReverseTextTask, messages: list[Message]) -> float:
    return reverse_text.reward(last_content(messages), task)


def exact_match(task: ReverseTextTask, messages: list[Message]) -> float:
    return float(last_content(messages).strip() == task.answer)


class ReverseTextEnv(SingleTurnEnv):
    name = "reverse_text"

    class Args(Section):
        num_train_tasks: int = Field(20_000, gt=0, description="Size of the training split.")
        num_eval_tasks: int = Field(500, gt=0, description="Size of the held-out split.")
        min_len: int = Field(reverse_text.MIN_LEN, description="Shortest text to reverse.")
        max_len: int = Field(reverse_text.MAX_LEN, description="Longest text to reverse.")
        data_seed: int = Field(0, description="Seed of the task generator (not of the task order).")

    def __init__(self, args: Args | None = None) -> None:
        super().__init__(args)
        a = self.args
        if not reverse_text.MIN_LEN <= a.min_len <= a.max_len <= reverse_text.MAX_LEN:
            raise ValueError(
                f"env.args: need {reverse_text.MIN_LEN} <= min_len <= max_len <= {reverse_text.MAX_LEN}"
            )
        self.splits: dict[str, list[ReverseTextTask]] = {}

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [
            RewardFunction("similarity", similarity, 1.0),
            RewardFunction("exact_match", exact_match, 0.0),
        ]

    def dataset(self, split: Split) -> Sequence[ReverseTextTask]:
        if split not in self.splits:
            a = self.args
            count = a.num_train_tasks if split == "train" else a.num_eval_tasks
            self.splits[split] = reverse_text.make_tasks(split, count, a.data_seed, a.min_len, a.max_len)
        return self.splits[split]

    def prompt(self, task: ReverseTextTask) -> list[Message]:
        return task.messages
