r"""Math: synthetic arithmetic and algebra problems, scored by the last `\boxed{...}` of the answer.

Three kinds of problem, each generated from a seed:
- `arithmetic`: an integer expression of `min_operands`..`max_operands` operands in
  [-max_value, max_value] with + − ×, nested parentheses, negatives written `(-4)`;
- `linear`: solve `a·x + b = c·x + d` for x (an integer solution by construction);
- `system`: two linear equations in x and y with an integer solution, answered as `(x, y)`.

The held-out split is chosen by a hash of the question text, so a question is in exactly one split
whatever the seed and arguments.

Answer rules (what `correct` accepts). The answer is the content of the LAST `\boxed{...}` in the
final assistant message (braces matched, so `\boxed{\frac{3}{4}}` works); without one the score is
0. Its content is compared as exact rational numbers, after removing whitespace, `$`, `\left`,
`\right` and a leading `x =`-style name per component:
- integers `12`, `-3`, `+4`, and thousands separators `1,234` for a one-number answer;
- fractions `3/4`, `-3/4`, `\frac{3}{4}` (also `\dfrac`, `\tfrac`, `-\frac{3}{4}`);
- decimals only when exact: `0.75` equals 3/4, `0.333` does not equal 1/3;
- pairs `(2, -3)`, `2, -3`, `x=2, y=-3` for systems (order x, y; named, either order, but the
  names must be x and y);
Anything else (words, units, `\sqrt`, more or fewer numbers than the answer has, a number of
over 1,000 characters) is not an answer and scores 0.
"""

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import Section
from tandem.envs.base import Message, RewardFunction, SingleTurnEnv, Split, last_content

Kind = Literal["arithmetic", "linear", "system"]
ANSWER_INSTRUCTION = r"Put the final answer in \boxed{}."
PAIR_INSTRUCTION = r"Put the final answer in \boxed{(x, y)}."


@dataclass(frozen=True)
class MathTask:
    task_id: str
    kind: Kind
    question: str
    answer: tuple[Fraction, ...]
    """One number, or (x, y) for a system."""

    @property
    def messages(self) -> list[Message]:
        instruction = PAIR_INSTRUCTION if len(self.answer) == 2 else ANSWER_INSTRUCTION
        return [{"role": "user", "content": f"{self.question} {instruction}"}]


# --- answers -----------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` with balanced braces; None when there is none. An
    unclosed one is skipped for the one before it, whose scan stops where the unclosed one begins
    (had it closed after that, the later one would have closed too): linear in the text, where
    rescanning to the end was quadratic (a repeated `\boxed{` held the event loop for minutes)."""
    end = len(text)
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth = 0
        for i in range(start + len("\\boxed"), end):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : i]
        end, start = start, text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
NAME = re.compile(r"^([a-zA-Z]\w*)=")
NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?$")
RATIO = re.compile(r"^[+-]?\d+/[+-]?\d+$")
THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+$")
MAX_NUMBER_CHARS = 1000  # far beyond any generated answer; Python refuses int strings of > 4300 digits
PAIR_NAMES = ("x", "y")


def parse_number(text: str) -> Fraction | None:
    if len(text) > MAX_NUMBER_CHARS:
        return None
    if NUMBER.match(text):
        return Fraction(text)  # Fraction("0.75") is exact
    if RATIO.match(text):
        numerator, denominator = text.split("/")
        return Fraction(int(numerator), int(denominator)) if int(denominator) != 0 else None
    return None


def parse_answer(text: str, components: int = 1) -> tuple[Fraction, ...] | None:
    """The `components` numbers of a boxed answer under the rules in the module docstring; None
    if it is not that many numbers. Thousands separators only in a one-number answer (in a pair
    `2, 345` is two numbers); named pair components must be x and y, in either order."""
    s = re.sub(r"\s+|\$|\\left|\\right|\\!|\\,", "", text)
    s = FRAC.sub(r"\1/\2", s)
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1]
    if components == 1:
        s = NAME.sub("", s, count=1)
        parts = [s.replace(",", "") if THOUSANDS.match(s) else s]
    else:
        parts = s.split(",")
    numbers, names = [], []
    for part in parts:
        name = NAME.match(part)
        value = parse_number(part[name.end() :] if name else part)
        if value is None:
            return None
        numbers.append(value)
        names.append(name.group(1) if name else None)
    if len(numbers) != components:
        return None
    if components == len(PAIR_NAMES) and any(names):  # x=2, y=-3 or y=-3, x=2; nothing else
        if sorted(n or "" for n in names) != sorted(PAIR_NAMES):
            return None
        numbers = [numbers[names.index(n)] for n in PAIR_NAMES]
    return tuple(numbers)


def has_boxed(task: MathTask, messages: list[Message]) -> float:
    return float(last_boxed(last_content(messages)) is not None)


def correct(task: MathTask, messages: list[Message]) -> float:
    boxed = last_boxed(last_content(messages))
    return float(boxed is not None and parse_answer(boxed, len(task.answer)) == task.answer)


# --- problems ----------------------------------------------------------------------------------


PRECEDENCE = {"+": 1, "-": 1, "*": 2}


@dataclass(frozen=True)
class Expr:
    text: str
    value: int
    op: str  # "" for a number


def operand(child: Expr, parent_op: str, right: bool, rng: random.Random) -> str:
    """The child's text, parenthesised when precedence needs it (and now and then when not)."""
    if not child.op:
        return child.text
    needed = PRECEDENCE[child.op] < PRECEDENCE[parent_op] or (
        right and parent_op == "-" and PRECEDENCE[child.op] == 1
    )
    return f"({child.text})" if needed or rng.random() < 0.3 else child.text


def expression(rng: random.Random, operands: int, max_value: int) -> Expr:
    """A random binary tree of + − × over `operands` integers; negatives are written `(-4)`."""
    if operands == 1:
        value = rng.randint(-max_value, max_value)
        return Expr(f"({value})" if value < 0 else str(value), value, "")
    left_count = rng.randint(1, operands - 1)
    left = expression(rng, left_count, max_value)
    right = expression(rng, operands - left_count, max_value)
    op = rng.choice("+-*")
    value = (
        left.value + right.value
        if op == "+"
        else left.value - right.value
        if op == "-"
        else left.value * right.value
    )
    text = f"{operand(left, op, False, rng)} {op} {operand(right, op, True, rng)}"
    return Expr(text, value, op)


def arithmetic(rng: random.Random, min_operands: int, max_operands: int, max_value: int) -> MathTask:
    expr = expression(rng, rng.randint(min_operands, max_operands), max_value)
    return MathTask("", "arithmetic", f"Compute {expr.text}.", (Fraction(expr.value),))


def linear_side(coefficient: int, constant: int) -> str:
    terms = []
    if coefficient:
        terms.append({1: "x", -1: "-x"}.get(coefficient, f"{coefficient}x"))
    if constant or not terms:
        terms.append(str(constant) if not terms else f"{'+' if constant > 0 else '-'} {abs(constant)}")
    return " ".join(terms)


def linear(rng: random.Random, max_value: int) -> MathTask:
    x = rng.randint(-max_value, max_value)
    a = rng.choice([k for k in range(-9, 10) if k])
    c = rng.choice([k for k in range(-9, 10) if k != a]) if rng.random() < 0.5 else 0
    b = rng.randint(-max_value, max_value)
    d = (a - c) * x + b
    question = f"Solve for x: {linear_side(a, b)} = {linear_side(c, d)}."
    return MathTask("", "linear", question, (Fraction(x),))


def equation_2(a: int, b: int, c: int) -> str:
    left = linear_side(a, 0) if a else ""
    y_term = {1: "y", -1: "-y"}.get(b, f"{b}y")
    if left:
        y_term = f"{'+' if b > 0 else '-'} {'y' if abs(b) == 1 else f'{abs(b)}y'}"
    return f"{left} {y_term} = {c}".strip()


def system(rng: random.Random, max_value: int) -> MathTask:
    x, y = rng.randint(-max_value, max_value), rng.randint(-max_value, max_value)
    while True:
        a1, b1, a2, b2 = (rng.choice([k for k in range(-6, 7) if k]) for _ in range(4))
        if a1 * b2 - a2 * b1 != 0:
            break
    question = (
        f"Solve the system: {equation_2(a1, b1, a1 * x + b1 * y)} and {equation_2(a2, b2, a2 * x + b2 * y)}."
    )
    return MathTask("", "system", question, (Fraction(x), Fraction(y)))


def is_eval_question(question: str) -> bool:
    """Held-out split by content: one question in ten, independent of seed and arguments."""
    return hashlib.sha256(question.encode()).digest()[0] % 10 == 0


class MathEnv(SingleTurnEnv):
    name = "math"

    class Args(Section):
        kinds: list[Kind] = Field(
            ["arithmetic", "linear", "system"], min_length=1, description="Kinds of problem, drawn uniformly."
        )
        min_operands: int = Field(2, ge=2, description="Fewest operands of an arithmetic problem.")
        max_operands: int = Field(4, ge=2, le=12, description="Most operands of an arithmetic problem.")
        max_value: int = Field(20, ge=1, le=10_000, description="Largest absolute value of a number.")
        num_train_tasks: int = Field(20_000, gt=0, description="Size of the training split.")
        num_eval_tasks: int = Field(500, gt=0, description="Size of the held-out split.")
        data_seed: int = Field(0, description="Seed of the problem generator (not of the task order).")

        @model_validator(mode="after")
        def _operands_ordered(self) -> "MathEnv.Args":
            if self.min_operands > self.max_operands:
                raise ValueError("min_operands must be <= max_operands")
            return self

    def __init__(self, args: Args | None = None) -> None:
        super().__init__(args)
        self.splits: dict[str, list[MathTask]] = {}

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [RewardFunction("correct", correct, 1.0), RewardFunction("has_boxed", has_boxed, 0.0)]

    def make(self, rng: random.Random) -> MathTask:
        a = self.args
        kind = rng.choice(a.kinds)
        if kind == "arithmetic":
            return arithmetic(rng, a.min_operands, a.max_operands, a.max_value)
        return linear(rng, a.max_value) if kind == "linear" else system(rng, a.max_value)

    def dataset(self, split: Split) -> Sequence[MathTask]:
        if split not in self.splits:
            a = self.args
            count = a.num_train_tasks if split == "train" else a.num_eval_tasks
            rng = random.Random(f"math/{split}/{a.data_seed}")
            tasks: list[MathTask] = []
            for _ in range(1000 * count):
                task = self.make(rng)
                if is_eval_question(task.question) == (split == "eval"):
                    tasks.append(
                        MathTask(f"{split}-{a.data_seed}-{len(tasks)}", task.kind, task.question, task.answer)
                    )
                    if len(tasks) == count:
                        break
            else:
                raise ValueError(f"env.args: cannot make {count} {split} problems; widen the ranges")
            self.splits[split] = tasks
        return self.splits[split]

    def prompt(self, task: MathTask) -> list[Message]:
        return task.messages
