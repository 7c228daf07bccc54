"""Code: the model writes a Python function; hidden tests run in the sandbox; reward = tests passed.

Problems live in `data/code_problems.jsonl`, one JSON object per line: `id`, `signature`,
`description`, `entry_point`, `solution` (a reference implementation, never shown to the model;
a test checks it passes every test) and `tests`, each `{"args": [...], "expected": ...}`. The
prompt gives the signature, the description and the first test as an example. The held-out
split is every `eval_every`-th problem; the rest is the training split. Another file in the same
format can be named with `problems_file`. `synthetic_tasks` adds generated problems to the
training split (eight templates such as "returns n times 3 plus -2" or "counts how often the
letter 'x' occurs in s", with random constants and arguments; held-out problems stay hand-written).

The answer is the last ```python (or bare ```) block of the model's final message. It runs as
`solution.py` in a `tandem.envs.sandbox.Sandbox` next to a harness that calls the entry point
on each test's arguments and prints each result as JSON as soon as it has it (so tests passed
before a timeout still count). Only the arguments enter the sandbox: the expected values, the
problems file and tandem itself lie on no path the program can open (the sandbox's root holds
the interpreter alone), and results are compared here, strictly by type (True is not 1, tuples
come back as lists), floats within 1e-6 relative.

Reward = fraction of tests passed; a sandbox that fails to set up raises `SandboxError` (the
rollout fails and is logged) rather than scoring the answer 0. Metrics: `has_code`, `passed_all` (binary success, for pass@k),
`timeout` (the program hit the wall-clock limit). Running tests is asynchronous, so the reward is
computed in `rollout_group` after sampling; the synchronous `reward_functions` hold only
`has_code` (a metric).
"""

import json
import math
import os
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from tandem.client.config import SamplingConfig
from tandem.client.inference import InferenceClient
from tandem.config.base import Section
from tandem.envs.base import (
    Message,
    RewardFunction,
    SingleTurnEnv,
    Split,
    Trajectory,
    gather_or_cancel,
    last_content,
)
from tandem.envs.sandbox import Isolation, Limits, Sandbox, SandboxError

PROBLEMS_FILE = Path(__file__).parent / "data" / "code_problems.jsonl"
CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

HARNESS = """\
import json, sys
out = sys.stdout
with open("cases.json") as f:
    config = json.load(f)
namespace = {"__name__": "solution"}
with open("solution.py") as f:
    exec(compile(f.read(), "solution.py", "exec"), namespace)
function = namespace.get(config["entry_point"])
for i, args in enumerate(config["args"]):
    try:
        if not callable(function):
            raise NameError("no function named " + config["entry_point"])
        line = json.dumps({"i": i, "result": function(*args)})
    except BaseException as e:
        line = json.dumps({"i": i, "error": (type(e).__name__ + ": " + str(e))[:300]})
    out.write(config["marker"] + line + "\\n")
    out.flush()
"""


@dataclass(frozen=True)
class CodeTask:
    task_id: str
    signature: str
    description: str
    entry_point: str
    tests: tuple[dict[str, Any], ...]
    solution: str = field(repr=False)

    @property
    def messages(self) -> list[Message]:
        example = self.tests[0]
        call = f"{self.entry_point}({', '.join(repr(a) for a in example['args'])})"
        text = (
            f"Write a Python function `{self.signature}` that {self.description}.\n"
            f"Example: `{call}` returns `{example['expected']!r}`.\n"
            "Answer with the complete function in a ```python code block."
        )
        return [{"role": "user", "content": text}]


PROBLEM_TEXT_FIELDS = ("id", "signature", "description", "entry_point", "solution")


def parse_problem(line: str) -> CodeTask:
    """One line of a problems file; ValueError says what is wrong with it."""
    try:
        p = json.loads(line)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(p, dict):
        raise ValueError("not a JSON object")
    for key in PROBLEM_TEXT_FIELDS:
        if not isinstance(p.get(key), str) or not p[key]:
            raise ValueError(f"'{key}' is missing or not a non-empty string")
    tests = p.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("'tests' is missing or not a non-empty list")
    for i, test in enumerate(tests):
        if not (isinstance(test, dict) and isinstance(test.get("args"), list) and "expected" in test):
            raise ValueError(f"test {i} must be an object with an 'args' list and an 'expected' value")
    return CodeTask(p["id"], p["signature"], p["description"], p["entry_point"], tuple(tests), p["solution"])


def load_problems(path: Path) -> list[CodeTask]:
    """Every problem of a JSONL file, each line checked here, at start: a bad line is a ValueError
    naming the file and line (which the registry reports as a configuration error)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # (not splitlines: JSON may hold U+2028)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"env.args.problems_file: cannot read {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    tasks = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            tasks.append(parse_problem(line))
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not a code problem: {e}") from None
    return tasks


# Synthetic problems: (signature, description, body) with constants {a} {b} {k} {c}, and the
# kind of argument the tests draw. The reference solution is `def signature:\n    body`.
TEMPLATES = [
    ("scale_and_shift(n: int) -> int", "returns n times {a} plus {b}", "return n * {a} + {b}", "int"),
    ("count_letter(s: str) -> int", "counts how often the letter '{c}' occurs in s", "return s.count('{c}')", "str"),
    ("is_divisible(n: int) -> bool", "tells whether n is divisible by {k}", "return n % {k} == 0", "int"),
    ("sum_above(nums: list[int]) -> int", "returns the sum of the elements of nums that are greater than {b}",
     "return sum(x for x in nums if x > {b})", "list"),
    ("last_chars(s: str) -> str", "returns the last {k} characters of s (all of s when it is shorter)",
     "return s[-{k}:]", "str"),
    ("repeat_each(s: str) -> str", "returns s with every character repeated {k} times",
     "return ''.join(ch * {k} for ch in s)", "str"),
    ("keep_multiples(nums: list[int]) -> list[int]", "returns the elements of nums that are multiples of {k}, in order",
     "return [x for x in nums if x % {k} == 0]", "list"),
    ("clamp(n: int) -> int", "returns n limited to the range from {lo} to {hi}", "return max({lo}, min({hi}, n))", "int"),
]  # fmt: skip


def synthetic_problems(count: int, seed: int, tests_per_problem: int = 6) -> list[CodeTask]:
    """`count` problems from TEMPLATES with random constants; expected values from the reference."""
    rng = random.Random(f"code/synthetic/{seed}")
    draw: dict[str, Callable[[], Any]] = {
        "int": lambda: rng.randint(-50, 50),
        "str": lambda: "".join(rng.choices("abcdexyz", k=rng.randint(0, 10))),
        "list": lambda: [rng.randint(-20, 20) for _ in range(rng.randint(0, 8))],
    }
    tasks = []
    for i in range(count):
        signature, description, body, kind = rng.choice(TEMPLATES)
        lo = rng.randint(-20, 0)
        constants = {
            "a": rng.randint(2, 9), "b": rng.randint(-9, 9), "k": rng.randint(2, 5),
            "c": rng.choice("abcdexyz"), "lo": lo, "hi": lo + rng.randint(5, 30),
        }  # fmt: skip
        solution = f"def {signature}:\n    {body.format(**constants)}\n"
        namespace: dict[str, Any] = {}
        exec(solution, namespace)  # our own template code, not a model's
        entry_point = signature.split("(")[0]
        tests = tuple(
            {"args": [arg], "expected": namespace[entry_point](arg)}
            for arg in (draw[kind]() for _ in range(tests_per_problem))
        )
        tasks.append(
            CodeTask(
                f"synthetic-{seed}-{i}",
                signature,
                description.format(**constants),
                entry_point,
                tests,
                solution,
            )
        )
    return tasks


def extract_code(text: str) -> str | None:
    """The last fenced code block of `text`, or None."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def same(got: Any, want: Any) -> bool:
    """JSON values equal by type: bools are not numbers, floats within 1e-6 relative."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, float) or isinstance(want, float):
        numbers = isinstance(got, int | float) and isinstance(want, int | float)
        return numbers and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, dict):
        return (
            isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
        )
    return type(got) is type(want) and got == want


@dataclass
class TestReport:
    passed: int
    total: int
    timed_out: bool
    stderr: str = ""

    @property
    def fraction(self) -> float:
        return self.passed / self.total


async def run_tests(sandbox: Sandbox, task: CodeTask, code: str) -> TestReport:
    """Run `code` against the task's tests in the sandbox and count the results that match."""
    marker = f"@@{uuid.uuid4().hex}@@"
    cases = {"entry_point": task.entry_point, "marker": marker, "args": [t["args"] for t in task.tests]}
    result = await sandbox.run(HARNESS, {"solution.py": code, "cases.json": json.dumps(cases)})
    if result.error is not None:  # the sandbox broke, not the answer: fail the rollout, do not score 0
        raise SandboxError(f"task {task.task_id}: {result.error}")
    results: dict[int, Any] = {}
    for line in result.stdout.splitlines():
        if not line.startswith(marker):
            continue
        try:
            item = json.loads(line[len(marker) :])
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("i"), int) and "result" in item:
            results[item["i"]] = item["result"]
    passed = sum(i in results and same(results[i], t["expected"]) for i, t in enumerate(task.tests))
    return TestReport(passed, len(task.tests), result.timed_out, result.stderr[-2000:])


def has_code(task: CodeTask, messages: list[Message]) -> float:
    return float(extract_code(last_content(messages)) is not None)


class CodeEnv(SingleTurnEnv):
    name = "code"
    success_metric = "passed_all"  # what pass@k counts in `evaluate`

    class Args(Section):
        problems_file: Path | None = Field(
            None, description="A JSONL file of problems; default: the built-in 40."
        )
        eval_every: int = Field(5, ge=2, description="Every N-th problem is held out for evaluation.")
        synthetic_tasks: int = Field(
            0,
            ge=0,
            description="Generated problems (8 templates, random constants) added to the training split.",
        )
        data_seed: int = Field(0, description="Seed of the generated problems.")
        timeout_s: float = Field(5.0, gt=0, description="Wall-clock limit of one program (all its tests).")
        memory_mb: int = Field(512, ge=64, description="Address-space limit of one program.")
        max_concurrent: int = Field(
            max(1, os.cpu_count() or 1), gt=0, description="Programs running at once in this process."
        )
        disk_mb: int = Field(64, ge=1, description="Disk space of one program (its whole job directory).")
        isolation: Isolation = Field(
            "auto",
            description="Sandbox isolation: auto (namespaces, else bubblewrap, else refuse), namespaces, "
            "bubblewrap, or unsafe-local (no isolation: trusted code only).",
        )

    def __init__(self, args: Args | None = None) -> None:
        super().__init__(args)
        a = self.args
        problems = load_problems(a.problems_file or PROBLEMS_FILE)
        self.splits: dict[str, list[CodeTask]] = {"train": [], "eval": []}
        for i, task in enumerate(problems):
            self.splits["eval" if i % a.eval_every == a.eval_every - 1 else "train"].append(task)
        if not self.splits["train"] or not self.splits["eval"]:
            raise ValueError(
                f"env.args: {len(problems)} problems leave a split empty with eval_every={a.eval_every}"
            )
        self.splits["train"] += synthetic_problems(a.synthetic_tasks, a.data_seed)
        limits = Limits(
            wall_seconds=a.timeout_s,
            cpu_seconds=math.ceil(a.timeout_s),
            memory_mb=a.memory_mb,
            disk_mb=a.disk_mb,
        )
        self.sandbox = Sandbox(limits, a.max_concurrent, a.isolation)

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [RewardFunction("has_code", has_code, 0.0)]

    def dataset(self, split: Split) -> Sequence[CodeTask]:
        return self.splits[split]

    def prompt(self, task: CodeTask) -> list[Message]:
        return task.messages

    async def score_code(self, task: CodeTask, messages: list[Message]) -> tuple[float, dict[str, float]]:
        """Reward and metrics of a finished answer (runs the tests; no code → 0)."""
        code = extract_code(last_content(messages))
        if code is None:
            return 0.0, {"has_code": 0.0, "passed_all": 0.0, "timeout": 0.0}
        report = await run_tests(self.sandbox, task, code)
        metrics = {
            "has_code": 1.0,
            "passed_all": float(report.passed == report.total),
            "timeout": float(report.timed_out),
        }
        return report.fraction, metrics

    async def rollout_group(
        self, task: CodeTask, client: InferenceClient, sampling: SamplingConfig, n: int
    ) -> list[Trajectory]:
        trajectories = await super().rollout_group(task, client, sampling, n)
        scores = await gather_or_cancel(*(self.score_code(task, t.messages) for t in trajectories))
        for trajectory, (reward, metrics) in zip(trajectories, scores, strict=True):
            trajectory.reward = reward
            trajectory.metrics.update(metrics)
        return trajectories
