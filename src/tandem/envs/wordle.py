"""Wordle: guess a secret five-letter word in `max_turns` tries, with per-letter feedback.

The model answers each turn with one word. The environment replies with one mark per letter,
written next to it so that a small model can read the letter and its mark together:

    c:G r:X a:Y n:X e:X

G = right letter in the right spot, Y = in the word elsewhere, X = not in the word (a repeated
letter is marked Y only as often as the secret holds it beyond its greens, as in Wordle).
An answer that is not a listed five-letter word is an invalid guess: it gets a reply saying why
(`"xyz" is not one five-letter word.`) and uses up a try. The episode ends on the right word or after `max_turns` tries.

Reward = win + 0.5 · speed bonus (1 for a first-try win, 0 for a win on the last try)
+ 0.5 · partial credit (the best valid guess's (2·greens + yellows) / 10; 1 on a win).
Metrics also report invalid guesses (weight 0); `win` averaged is the win rate.

Secrets come from `data/wordle_answers.txt` (common words); guesses may be any word of
`data/wordle_guesses.txt` (a superset). The train and eval splits divide the secrets by a hash
of the word, so they are disjoint whatever the seed.
"""

import random
import re
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import Field

from tandem.envs.base import Message, RewardFunction, Split, last_content
from tandem.envs.multi_turn import MultiTurnEnv

DATA = Path(__file__).parent / "data"
WORD_LEN = 5
GREEN, YELLOW, GRAY = "G", "Y", "X"


@cache
def answers() -> tuple[str, ...]:
    return tuple((DATA / "wordle_answers.txt").read_text().split())


@cache
def allowed_guesses() -> frozenset[str]:
    return frozenset((DATA / "wordle_guesses.txt").read_text().split()) | frozenset(answers())


def is_eval_word(word: str) -> bool:
    """Held-out secrets: one in five, by a hash of the word."""
    return zlib.crc32(word.encode()) % 5 == 0


def split_words(split: Split) -> list[str]:
    return [w for w in answers() if is_eval_word(w) == (split == "eval")]


def feedback(guess: str, secret: str) -> str:
    """The five marks of `guess` against `secret`, e.g. 'GXYXX'."""
    marks = [GRAY] * WORD_LEN
    unmatched = Counter(s for g, s in zip(guess, secret, strict=True) if g != s)
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[i] = GREEN
        elif unmatched[g] > 0:
            marks[i] = YELLOW
            unmatched[g] -= 1
    return "".join(marks)


def format_feedback(guess: str, marks: str) -> str:
    return " ".join(f"{letter}:{mark}" for letter, mark in zip(guess, marks, strict=True))


def parse_guess(text: str) -> str:
    """The answer as a lowercase word, without surrounding space, quotes or final punctuation."""
    return text.strip().strip("\"'`*.!").strip().lower()


@dataclass(frozen=True)
class Guess:
    word: str
    valid: bool
    marks: str  # '' when invalid
    problem: str  # why it is invalid ('' when valid)

    @property
    def score(self) -> float:
        """Partial credit of this guess: (2·greens + yellows) / 10."""
        return (2 * self.marks.count(GREEN) + self.marks.count(YELLOW)) / (2 * WORD_LEN)


def judge(text: str, secret: str) -> Guess:
    word = parse_guess(text)
    if not re.fullmatch(r"[a-z]{5}", word):
        return Guess(word, False, "", "is not one five-letter word")
    if word not in allowed_guesses():
        return Guess(word, False, "", "is not in the word list")
    return Guess(word, True, feedback(word, secret), "")


@dataclass(frozen=True)
class WordleTask:
    task_id: str
    secret: str


def guesses(task: WordleTask, messages: list[Message]) -> list[Guess]:
    return [judge(m.get("content") or "", task.secret) for m in messages if m.get("role") == "assistant"]


def won(task: WordleTask, messages: list[Message]) -> int:
    """The try (1-based) that found the secret, 0 when none did."""
    for k, guess in enumerate(guesses(task, messages), start=1):
        if guess.word == task.secret:
            return k
    return 0


def win(task: WordleTask, messages: list[Message]) -> float:
    return float(won(task, messages) > 0)


def partial_credit(task: WordleTask, messages: list[Message]) -> float:
    return max((g.score for g in guesses(task, messages) if g.valid), default=0.0)


def invalid_guesses(task: WordleTask, messages: list[Message]) -> float:
    return float(sum(not g.valid for g in guesses(task, messages)))


class WordleEnv(MultiTurnEnv):
    name = "wordle"

    class Args(MultiTurnEnv.Args):
        max_turns: int = Field(6, ge=2, description="Tries per game (one model turn each).")
        data_seed: int = Field(0, description="Seed of the order of the secrets in each split.")

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [
            RewardFunction("win", win, 1.0),
            RewardFunction("speed_bonus", self.speed_bonus, 0.5),
            RewardFunction("partial_credit", partial_credit, 0.5),
            RewardFunction("invalid_guesses", invalid_guesses, 0.0),
        ]

    def speed_bonus(self, task: WordleTask, messages: list[Message]) -> float:
        k = won(task, messages)
        return (self.args.max_turns - k) / (self.args.max_turns - 1) if k else 0.0

    def dataset(self, split: Split) -> Sequence[WordleTask]:
        words = split_words(split)
        random.Random(f"wordle/{split}/{self.args.data_seed}").shuffle(words)
        return [WordleTask(f"wordle-{split}-{w}", w) for w in words]

    def prompt(self, task: WordleTask) -> list[Message]:
        return [{"role": "user", "content": instructions(self.args.max_turns)}]

    async def env_response(self, task: WordleTask, messages: list[Message]) -> list[Message] | None:
        guess = judge(last_content(messages), task.secret)
        if guess.word == task.secret:
            return None
        return [{"role": "user", "content": reply(guess)}]

    def turn_info(self, task: WordleTask, messages: list[Message]) -> dict[str, Any]:
        guess = judge(last_content(messages), task.secret)
        return {"guess": guess.word, "valid": guess.valid, "marks": guess.marks}


def instructions(max_turns: int) -> str:
    return (
        f"Wordle: guess the secret five-letter word in {max_turns} tries. Answer with one word. "
        "Marks: G = right spot, Y = wrong spot, X = not in the word."
    )


def reply(guess: Guess) -> str:
    if not guess.valid:
        return f'"{guess.word}" {guess.problem}.'
    return format_feedback(guess.word, guess.marks)
