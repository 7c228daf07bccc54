"""The math environment without a server: generated problems are right, splits, answer parsing, rewards."""

import random
import re
from fractions import Fraction

import pytest

from tandem.config.loader import ConfigError
from tandem.envs.math_env import MathEnv, MathTask, last_boxed, parse_answer
from tandem.envs.registry import load_environment


def evaluate(text: str, x: Fraction = Fraction(0), y: Fraction = Fraction(0)) -> Fraction:
    """Evaluate a generated expression or equation side independently of the generator."""
    python = re.sub(r"(\d)([xy])", r"\1*\2", text)
    python = re.sub(r"(-?\d+)", r"Fraction(\1)", python)
    return eval(python, {"Fraction": Fraction, "x": x, "y": y})


def check_answer(task: MathTask) -> None:
    if task.kind == "arithmetic":
        assert evaluate(task.question.removeprefix("Compute ").removesuffix(".")) == task.answer[0]
        return
    body = task.question.split(": ", 1)[1].removesuffix(".")
    equations = body.split(" and ")
    assert len(equations) == (2 if task.kind == "system" else 1)
    x, y = task.answer if task.kind == "system" else (task.answer[0], Fraction(0))
    for equation in equations:
        left, right = equation.split(" = ")
        assert evaluate(left, x, y) == evaluate(right, x, y), task.question


def test_generated_problems_have_the_stated_answers() -> None:
    env = MathEnv(MathEnv.Args(num_train_tasks=600, num_eval_tasks=60, max_operands=6))
    tasks = list(env.dataset("train")) + list(env.dataset("eval"))
    assert {t.kind for t in tasks} == {"arithmetic", "linear", "system"}
    for task in tasks:
        check_answer(task)
    operand_counts = {len(re.findall(r"\d+", t.question)) for t in tasks if t.kind == "arithmetic"}
    assert operand_counts == {2, 3, 4, 5, 6}
    assert any("(-" in t.question for t in tasks) and any("((" in t.question for t in tasks)


def test_splits_are_disjoint_seeded_and_sized() -> None:
    env = load_environment("math", {"num_train_tasks": 400, "num_eval_tasks": 40, "kinds": ["linear"]})
    train, held_out = env.dataset("train"), env.dataset("eval")
    assert len(train) == 400 and len(held_out) == 40
    assert {t.question for t in train}.isdisjoint({t.question for t in held_out})
    assert all(t.kind == "linear" for t in train)
    again = MathEnv(env.args).dataset("train")
    assert [t.question for t in again] == [t.question for t in train]
    other_seed = MathEnv(env.args.model_copy(update={"data_seed": 1})).dataset("train")
    assert [t.question for t in other_seed] != [t.question for t in train]
    assert len({t.task_id for t in train}) == 400


def test_bad_args_name_the_key() -> None:
    with pytest.raises(ConfigError, match="env.args.kinds"):
        load_environment("math", {"kinds": ["geometry"]})
    with pytest.raises(ConfigError, match="min_operands must be <= max_operands"):
        load_environment("math", {"min_operands": 5, "max_operands": 3})


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so \boxed{12}.", "12"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{3}{4}} is it", r"\frac{3}{4}"),
        (r"\boxed{3} and \boxed{4", "3"),  # the last one is unbalanced: the one before counts
        ("no box here", None),
        (r"\boxed{}", ""),
    ],
)
def test_last_boxed(text: str, content: str | None) -> None:
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    ("answer", "numbers"),
    [
        ("12", (12,)),
        (" -3 ", (-3,)),
        ("+4", (4,)),
        ("1,234", (1234,)),
        ("x=1,234", (1234,)),
        ("3/4", (Fraction(3, 4),)),
        (r"-\frac{3}{4}", (Fraction(-3, 4),)),
        (r"\dfrac{6}{8}", (Fraction(3, 4),)),
        ("0.75", (Fraction(3, 4),)),
        ("$x = 5$", (5,)),
        ("(2, -3)", (2, -3)),
        (r"\left(2,-3\right)", (2, -3)),
        ("x=2, y=-3", (2, -3)),
        ("y=-3, x=2", (2, -3)),  # named: in either order
        ("2, 345", (2, 345)),  # a pair, not a thousands separator
        ("(1,234)", (1, 234)),
        ("0.333", (Fraction(333, 1000),)),
    ],
)
def test_parse_answer(answer: str, numbers: tuple) -> None:
    assert parse_answer(answer, len(numbers)) == tuple(Fraction(n) for n in numbers)


@pytest.mark.parametrize(
    ("answer", "components"),
    [
        ("1/0", 1),
        ("five", 1),
        (r"\sqrt{2}", 1),
        ("", 1),
        ("2 apples", 1),
        ("2, 3", 1),
        ("2", 2),
        ("1, 2, 3", 2),
        ("x=2, x=-3", 2),
        ("a=2, b=-3", 2),
        ("x=2, -3", 2),  # one name: which is which is unclear
        ("1" * 5000, 1),  # past Python's int-string limit: not a number, not an error
        ("1/" + "1" * 5000, 1),
    ],
)
def test_parse_answer_refuses(answer: str, components: int) -> None:
    assert parse_answer(answer, components) is None


def reference_last_boxed(text: str) -> str | None:
    """The obvious definition (each unclosed box rescanned to the end): quadratic, for checking."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : i]
        start = text.rfind("\\boxed{", 0, start)
    return None


def test_last_boxed_equals_the_definition_and_stays_linear() -> None:
    rng = random.Random(0)
    pieces = ["\\boxed{", "{", "}", "7", " "]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        assert last_boxed(text) == reference_last_boxed(text), text
    # a degenerate answer: 20,000 unclosed boxes after a closed one took the definition minutes
    assert last_boxed("\\boxed{5}" + "\\boxed{" * 20_000) == "5"


def reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_rewards_score_the_last_boxed_answer_exactly() -> None:
    env = MathEnv()
    one = MathTask("t", "linear", "Solve for x: 4x = 3.", (Fraction(3, 4),))
    pair = MathTask("p", "system", "Solve the system: x + y = -1 and x - y = 5.", (Fraction(2), Fraction(-3)))
    cases = [
        (one, r"x = 3/4, so \boxed{0.75}", 1.0, 1.0),
        (one, r"\boxed{\frac{3}{4}}", 1.0, 1.0),
        (one, r"\boxed{3/4} no wait \boxed{0.7}", 0.0, 1.0),
        (one, r"\boxed{0.7} no wait \boxed{3/4}", 1.0, 1.0),
        (one, "the answer is 3/4", 0.0, 0.0),
        (one, r"\boxed{three quarters}", 0.0, 1.0),
        (pair, r"\boxed{(2, -3)}", 1.0, 1.0),
        (pair, r"\boxed{(-3, 2)}", 0.0, 1.0),
        (pair, r"\boxed{2}", 0.0, 1.0),
        (pair, r"\boxed{y=-3, x=2}", 1.0, 1.0),
        (pair, r"\boxed{y=2, x=-3}", 0.0, 1.0),  # the names say which is which
    ]
    for task, text, right, boxed in cases:
        assert env.score(task, reply(text)) == (right, {"correct": right, "has_boxed": boxed}), text
    assert env.score(one, []) == (0.0, {"correct": 0.0, "has_boxed": 0.0})


def test_prompt_asks_for_a_boxed_answer() -> None:
    env = MathEnv(MathEnv.Args(num_eval_tasks=30))
    for task in env.dataset("eval"):
        [message] = env.prompt(task)
        assert message["role"] == "user" and message["content"].startswith(task.question)
        assert ("(x, y)" in message["content"]) == (task.kind == "system")
