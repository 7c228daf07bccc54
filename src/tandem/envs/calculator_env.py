r"""Calculator: arithmetic word problems, with a `calculate` tool; the example tool environment.

Each task is a short word problem whose answer needs one to three operations on numbers up to
`max_value`. The model may call `calculate(expression)` (exact arithmetic on + − × ÷, //, %, **
and parentheses, through a small AST evaluator: no names, no attributes, bounded powers) as often
as it likes within `max_turns`, then answers with `\boxed{...}`, checked exactly as in the math
environment (`tandem.envs.math_env`). Metrics: correct, has_boxed, tool_calls, tool_errors.
"""

import ast
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from pydantic import Field

from tandem.envs.base import Message, RewardFunction, Split
from tandem.envs.math_env import MathTask, correct, has_boxed, is_eval_question
from tandem.envs.tools import Tool, ToolEnv, count_tool_calls, count_tool_errors

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 100
OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ValueError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        result = Fraction(OPERATORS[type(node.op)](left, right))
        if len(str(result.numerator)) + len(str(result.denominator)) > MAX_DIGITS:
            raise ValueError("the number is too large")
        return result
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly; a whole number prints as one, else as a decimal."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    value = evaluate(tree)
    return str(value.numerator) if value.denominator == 1 else repr(float(value))


CALCULATOR = Tool(
    name="calculate",
    description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "For example (12 + 30) * 4"}},
        "required": ["expression"],
    },
    fn=calculate,
)


def problem(rng: random.Random, top: int) -> tuple[str, int]:
    """One word problem and its whole-number answer."""
    kind = rng.randrange(5)
    a, b, c = rng.randint(2, top), rng.randint(2, top), rng.randint(2, max(2, top // 10))
    if kind == 0:
        return f"A farm has {a} rows of {b} apple trees. How many apple trees are there?", a * b
    if kind == 1:
        stock = b * c + a
        return (
            f"A shop has {stock} boxes and sells {b} boxes a day for {c} days. How many boxes are left?",
            stock - b * c,
        )
    if kind == 2:
        return f"{c} friends share {a * c} coins equally. How many coins does each friend get?", a
    if kind == 3:
        return (
            f"A train goes {a} km per hour for {c} hours and then {b} km more. How many km does it go in total?",
            a * c + b,
        )
    return (
        f"A ticket costs {a} dollars. A school buys {b} tickets and pays with a {c}-dollar voucher. How much does it pay?",
        a * b - c,
    )


@dataclass(frozen=True)
class WordProblem(MathTask):
    @property
    def messages(self) -> list[Message]:
        text = f"{self.question} Use the calculate tool if it helps. Put the final answer in \\boxed{{}}."
        return [{"role": "user", "content": text}]


class CalculatorEnv(ToolEnv):
    name = "calculator"

    class Args(ToolEnv.Args):
        max_turns: int = Field(4, gt=0, description="Most model turns per episode (tool calls take turns).")
        max_value: int = Field(999, ge=10, le=10**9, description="Largest number in a problem.")
        num_train_tasks: int = Field(20_000, gt=0, description="Size of the training split.")
        num_eval_tasks: int = Field(500, gt=0, description="Size of the held-out split.")
        data_seed: int = Field(0, description="Seed of the problem generator (not of the task order).")

    def __init__(self, args: Args | None = None) -> None:
        super().__init__(args)
        self.splits: dict[str, list[WordProblem]] = {}

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [
            RewardFunction("correct", correct, 1.0),
            RewardFunction("has_boxed", has_boxed, 0.0),
            RewardFunction("tool_calls", count_tool_calls, 0.0),
            RewardFunction("tool_errors", count_tool_errors, 0.0),
        ]

    def available_tools(self, task: WordProblem) -> list[Tool]:
        return [CALCULATOR]

    def dataset(self, split: Split) -> Sequence[WordProblem]:
        if split not in self.splits:
            a = self.args
            count = a.num_train_tasks if split == "train" else a.num_eval_tasks
            rng = random.Random(f"calculator/{split}/{a.data_seed}")
            tasks: list[WordProblem] = []
            while len(tasks) < count:
                question, answer = problem(rng, a.max_value)
                if is_eval_question(question) == (split == "eval"):
                    task_id = f"{split}-{a.data_seed}-{len(tasks)}"
                    tasks.append(WordProblem(task_id, "arithmetic", question, (Fraction(answer),)))
            self.splits[split] = tasks
        return self.splits[split]

    def prompt(self, task: WordProblem) -> list[Message]:
        return task.messages
