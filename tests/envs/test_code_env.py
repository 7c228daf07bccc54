"""The code environment: problems are sound, answers are extracted and scored in the real sandbox,
reward hacks and hostile programs score 0, and rollouts against a real server carry the metrics."""

import asyncio
import json
import os
from pathlib import Path

import pytest

from tandem.client.config import ClientConfig, SamplingConfig
from tandem.client.inference import InferenceClient
from tandem.config.loader import ConfigError
from tandem.envs.code_env import (
    PROBLEMS_FILE,
    CodeEnv,
    CodeTask,
    extract_code,
    run_tests,
    same,
    synthetic_problems,
)
from tandem.envs.registry import load_environment
from tandem.envs.sandbox import Limits, Sandbox, SandboxError
from tandem.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def env() -> CodeEnv:
    return CodeEnv(CodeEnv.Args(timeout_s=3.0))


def answer(code: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": f"Here it is:\n```python\n{code}\n```\nDone."}]


def score(env: CodeEnv, task: CodeTask, code: str | None, text: str | None = None):
    messages = [{"role": "assistant", "content": text}] if text is not None else answer(code or "")
    return asyncio.run(env.score_code(task, messages))


def task_named(env: CodeEnv, name: str) -> CodeTask:
    return next(t for split in ("train", "eval") for t in env.dataset(split) if t.task_id == name)


def test_every_reference_solution_passes_all_its_tests(env: CodeEnv) -> None:
    tasks = [*env.dataset("train"), *env.dataset("eval")]
    assert len(tasks) == 40 and len(env.dataset("eval")) == 8
    assert len({t.task_id for t in tasks}) == 40

    async def run_all():
        return await asyncio.gather(*(run_tests(env.sandbox, t, t.solution) for t in tasks))

    reports = asyncio.run(run_all())
    failing = [
        (t.task_id, r.passed, r.total, r.stderr[-300:])
        for t, r in zip(tasks, reports, strict=True)
        if r.passed != r.total
    ]
    assert failing == []
    assert all(r.total >= 4 for r in reports)


def test_synthetic_problems_are_right_seeded_and_for_training_only(env: CodeEnv) -> None:
    mixed = CodeEnv(CodeEnv.Args(synthetic_tasks=24, data_seed=3))
    synthetic = [t for t in mixed.dataset("train") if t.task_id.startswith("synthetic-")]
    assert len(synthetic) == 24 and len(mixed.dataset("eval")) == 8
    assert len({t.entry_point for t in synthetic}) >= 6  # most of the eight templates
    assert [t.solution for t in synthetic] == [t.solution for t in synthetic_problems(24, 3)]
    assert [t.solution for t in synthetic] != [t.solution for t in synthetic_problems(24, 4)]

    async def run_all():
        return await asyncio.gather(*(run_tests(env.sandbox, t, t.solution) for t in synthetic))

    assert all(r.passed == r.total == 6 for r in asyncio.run(run_all()))


def test_prompt_shows_signature_and_first_example(env: CodeEnv) -> None:
    task = task_named(env, "add_digits")
    [message] = env.prompt(task)
    assert "`add_digits(n: int) -> int`" in message["content"]
    assert "`add_digits(123)` returns `6`" in message["content"] and "```python" in message["content"]


def test_partial_credit_is_the_fraction_of_tests_passed(env: CodeEnv) -> None:
    task = task_named(env, "add_digits")  # tests: 123, 0, 9, 99999, 1000001, 4567
    assert score(env, task, "def add_digits(n):\n    return sum(map(int, str(n)))") == (
        1.0,
        {"has_code": 1.0, "passed_all": 1.0, "timeout": 0.0},
    )
    reward, metrics = score(env, task, "def add_digits(n):\n    return n % 10")  # right for 0 and 9
    assert reward == pytest.approx(2 / 6) and metrics["passed_all"] == 0.0


@pytest.mark.parametrize(
    ("code", "why"),
    [
        ("def add_digits(n):\n    return 'six'", "wrong type"),
        ("def add_digits(n)\n    return 6", "syntax error"),
        ("def other(n):\n    return 6", "wrong name"),
        ("raise SystemExit(0)", "exits before the tests"),
        (
            "class Any:\n    def __eq__(self, other):\n        return True\n"
            "def add_digits(n):\n    return Any()",
            "an object equal to everything cannot leave the sandbox",
        ),
        ("def add_digits(n):\n    return n > 0", "True is not 1"),
        ("import os\nos.system('rm -rf /')\ndef add_digits(n):\n    return -1", "hostile"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 80))", "network"),
        ("x = bytearray(10 * 1024**3)", "memory"),
        ("import os\nwhile True:\n    os.fork()", "fork bomb"),
        (
            "open('/tmp/tandem-code-escape', 'w').write('x')\ndef add_digits(n):\n    return -1",
            "write outside",
        ),
        ("while True:\n    pass", "loops forever"),
    ],
)
def test_broken_and_hostile_answers_score_zero(env: CodeEnv, code: str, why: str) -> None:
    task = task_named(env, "add_digits")
    reward, metrics = score(env, task, code)
    assert reward == 0.0, why
    assert metrics["has_code"] == 1.0 and metrics["passed_all"] == 0.0
    assert metrics["timeout"] == float(why == "loops forever")
    assert not Path("/tmp/tandem-code-escape").exists()


def test_a_timeout_keeps_the_tests_passed_before_it(env: CodeEnv) -> None:
    task = task_named(env, "add_digits")
    code = "def add_digits(n):\n    while n == 99999:\n        pass\n    return sum(map(int, str(n)))"
    reward, metrics = score(env, task, code)
    assert reward == pytest.approx(3 / 6)  # 123, 0, 9 before the loop
    assert metrics["timeout"] == 1.0 and metrics["passed_all"] == 0.0


def test_a_broken_sandbox_fails_the_rollout_instead_of_scoring_zero() -> None:
    env = CodeEnv(CodeEnv.Args(timeout_s=3.0))
    env.sandbox = Sandbox(Limits(disk_mb=1))  # the job's files cannot even be written
    task = task_named(env, "add_digits")
    with pytest.raises(SandboxError, match="task add_digits: "):
        score(env, task, "def add_digits(n):\n    return 6\n" + "#" * (2 << 20))


ANSWER_KEY = f"""
import json
expected = {{}}
for line in open({str(PROBLEMS_FILE)!r}):
    problem = json.loads(line)
    for test in problem["tests"]:
        expected[json.dumps(test["args"])] = test["expected"]
def add_digits(n):
    return expected[json.dumps([n])]
"""
ESCAPES = {
    "reads the answer key": ANSWER_KEY,
    "remounts and writes outside": (
        "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.mount(None, b'/', None, 0x21020, None)\n"
        "libc.umount2(b'/proc', 2)\nopen('OUTSIDE', 'w').write('x')\n"
    ),
    "unix socket to an outside listener": (
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('SOCKET')\ns.sendall(b'6')\n"
    ),
    "host processes": (
        "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit() and p != '1':\n"
        "        os.kill(int(p), 9)\nos.kill(PID, 9)\n"
    ),
    "fills the disk": ("n = 0\nwhile True:\n    open(f'f{n}', 'wb').write(b'x' * (1 << 20))\n    n += 1\n"),
    "directory fd": "import os\nroot = os.open('/', os.O_RDONLY)\nos.open('x', os.O_CREAT | os.O_WRONLY, dir_fd=root)\n",
    "signals its parent": "import os\nos.kill(os.getppid(), 9)\nos.kill(PID, 9)\nos.kill(-1, 9)\n",
}


def test_each_escape_class_scores_zero_writes_nothing_and_the_run_goes_on(
    env: CodeEnv, tmp_path: Path
) -> None:
    import socket

    task = task_named(env, "add_digits")
    outside, path = tmp_path / "escaped.txt", tmp_path / "listener.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        listener.settimeout(0.1)
        for why, code in ESCAPES.items():
            code = (
                code.replace("OUTSIDE", str(outside))
                .replace("SOCKET", str(path))
                .replace("PID", str(os.getpid()))
            )
            wrapped = code if "def add_digits" in code else code + "def add_digits(n):\n    return -1\n"
            reward, metrics = score(env, task, wrapped)
            assert reward == 0.0 and metrics["passed_all"] == 0.0, why
        with pytest.raises(TimeoutError):
            listener.accept()
    assert not outside.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["listener.sock"]
    reward, _ = score(env, task, task.solution)  # and the run goes on
    assert reward == 1.0


def test_answers_without_a_code_block_score_zero_without_running(env: CodeEnv) -> None:
    task = task_named(env, "add_digits")
    no_block = "def add_digits(n):\n    return sum(map(int, str(n)))"
    assert score(env, task, None, text=no_block) == (
        0.0,
        {"has_code": 0.0, "passed_all": 0.0, "timeout": 0.0},
    )
    assert env.score(task, [{"role": "assistant", "content": no_block}]) == (0.0, {"has_code": 0.0})


def test_extract_code_takes_the_last_block() -> None:
    assert extract_code("```python\nA\n```\ntext\n```\nB\n```") == "B\n"
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\nunterminated") is None
    assert extract_code("no code") is None


def test_same_is_strict_about_types() -> None:
    assert same([1, [2.0000001, "a"]], [1, [2.0, "a"]])
    assert same({"a": 1}, {"a": 1}) and not same({"a": 1}, {"a": 1, "b": 2})
    assert not same(True, 1) and not same(1, True) and not same(0, None) and not same("1", 1)
    assert same(3, 3.0) and not same([1, 2], [1, 2, 3])


def test_problem_files_and_args_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x"}) + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1: not a code problem"):
        load_environment("code", {"problems_file": str(bad)})
    with pytest.raises(ConfigError, match="env.args.timeout_s"):
        load_environment("code", {"timeout_s": 0})


GOOD = json.loads(PROBLEMS_FILE.read_text().split("\n")[0])


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        (
            {**GOOD, "tests": [{"args": [1]}]},
            "test 0 must be an object with an 'args' list and an 'expected' value",
        ),
        (
            {**GOOD, "tests": [*GOOD["tests"], {"expected": 1}]},
            "test 6 must be an object with an 'args' list",
        ),
        ({**GOOD, "tests": [{"args": 5, "expected": 1}]}, "test 0 must be an object with an 'args' list"),
        ({**GOOD, "tests": "abc"}, "'tests' is missing or not a non-empty list"),
        ({**GOOD, "tests": []}, "'tests' is missing or not a non-empty list"),
        ({**GOOD, "id": 5}, "'id' is missing or not a non-empty string"),
        ([GOOD], "not a JSON object"),
    ],
)
def test_a_malformed_problem_stops_the_start_naming_its_file_and_line(
    row: object, problem: str, tmp_path: Path
) -> None:
    """Each line is checked when the environment is built: a test without `expected` or `args`
    loaded before and failed every rollout of its problem (KeyError, no file or line named)."""
    path = tmp_path / "problems.jsonl"
    lines = [json.dumps(GOOD | {"id": f"p{i}"}) for i in range(6)]
    path.write_text("\n".join([*lines[:2], "", json.dumps(row), *lines[2:]]) + "\n")
    with pytest.raises(ConfigError) as raised:
        load_environment("code", {"problems_file": str(path)})
    assert str(raised.value).startswith(f"{path}:4: not a code problem: {problem}")


def test_a_missing_problems_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(ConfigError) as raised:
        load_environment("code", {"problems_file": str(missing)})
    assert str(raised.value) == f"env.args.problems_file: cannot read {missing}: No such file or directory"


def test_rollouts_against_a_real_server(env: CodeEnv, server: str, model: Path) -> None:
    """A random tiny model writes no code block: reward 0 with every metric present, tokens intact."""
    url = server
    task = env.dataset("eval")[0]

    async def play():
        client = InferenceClient(url, ClientConfig(request_timeout=60))
        await client.connect()
        try:
            return await env.rollout_group(task, client, SamplingConfig(max_tokens=24), 3)
        finally:
            await client.close()

    trajectories = asyncio.run(play())
    tokenizer = load_tokenizer(str(model))
    expected_prompt = tokenizer.apply_chat_template(
        env.prompt(task), add_generation_prompt=True, tokenize=False
    )
    for t in trajectories:
        assert t.prompt_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
        assert 0 < len(t.completion_ids) <= 24 and t.completion_mask == [1] * len(t.completion_ids)
        assert set(t.metrics) == {"has_code", "passed_all", "timeout"}
        has_code = extract_code(t.messages[-1]["content"]) is not None
        assert t.metrics["has_code"] == float(has_code) and (has_code or t.reward == 0.0)
