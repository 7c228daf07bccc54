"""Tool calling: parsing (malformed calls included), argument checks, execution, the calculator, the
chat template's rendering, and tool episodes against a real inference server."""

import asyncio
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from tandem.client.config import ClientConfig, SamplingConfig
from tandem.client.inference import InferenceClient
from tandem.envs.base import Message
from tandem.envs.calculator_env import CALCULATOR, CalculatorEnv, WordProblem, calculate
from tandem.envs.registry import load_environment
from tandem.envs.tools import Tool, ToolCall, check_value, execute, parse_tool_calls
from tandem.models.loading import load_tokenizer
from tandem.models.tokenizer import train_tokenizer


def call_text(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_parse_one_and_several_calls_with_text_around() -> None:
    text = (
        "Let me compute.\n"
        + call_text('{"name": "calculate", "arguments": {"expression": "1 + {2}"}}')
        + "\nand\n"
        + call_text('{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}')
        + "<|im_end|>"
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculate", {"expression": "1 + {2}"}),
        ToolCall("lookup", {"key": "a"}),  # arguments as a JSON string (OpenAI style)
    ]
    assert parse_tool_calls("The answer is \\boxed{3}.") == []
    assert parse_tool_calls(call_text('{"name": "ping"}')) == [ToolCall("ping", {})]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (call_text('{"name": "calculate", "arguments": {"expression": "1+1"'), "not valid JSON"),
        (call_text("calculate(1+1)"), "not valid JSON"),
        (call_text('{"arguments": {}}'), '"name" string'),
        (call_text('["calculate"]'), '"name" string'),
        (call_text('{"name": "calculate", "arguments": [1]}'), "must be a JSON object"),
        (call_text('{"name": "calculate", "arguments": "{oops"}'), "arguments string is not valid JSON"),
        ('<tool_call>\n{"name": "calculate", "argu', "not valid JSON"),  # cut off mid-call
        ("<tool_call>", "not valid JSON"),
        (call_text('{"name": "calculate", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"), "not valid JSON"),
        (
            call_text('{"name": "calculate", "arguments": "' + "[" * 5000 + '"}'),
            "arguments string is not valid",
        ),
    ],
)
def test_malformed_calls_become_calls_with_an_error(text: str, error: str) -> None:
    [call] = parse_tool_calls(text)
    assert call.error is not None and error in call.error


def test_an_unterminated_last_call_still_counts() -> None:
    text = call_text('{"name": "a", "arguments": {}}') + '\n<tool_call>\n{"name": "b", "arguments": {}}'
    assert [c.name for c in parse_tool_calls(text)] == ["a", "b"]


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "word": {"type": "string"},
        "count": {"type": "integer"},
        "scale": {"type": "number"},
        "mode": {"type": "string", "enum": ["up", "down"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["word"],
}


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"word": "a", "count": 2, "scale": 0.5, "mode": "up", "tags": ["x"]}, None),
        ({"word": "a", "scale": 2}, None),  # an integer is a number
        ({}, "missing the required argument 'word'"),
        ({"word": 3}, "argument 'word' must be of type string, not int"),
        ({"word": "a", "count": True}, "argument 'count' must be of type integer, not bool"),
        ({"word": "a", "count": 1.5}, "must be of type integer, not float"),
        ({"word": "a", "mode": "sideways"}, "must be one of ['up', 'down']"),
        ({"word": "a", "tags": ["x", 1]}, "argument 'tags'[1] must be of type string"),
        ({"word": "a", "colour": "red"}, "unknown argument 'colour'"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments: dict, problem: str | None) -> None:
    found = check_value(SCHEMA, arguments, "the arguments")
    assert found == problem if problem is None else (found is not None and problem in found)


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


async def slow_async(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "late"


def broken() -> str:
    raise RuntimeError("the database is down")


def test_execute_answers_every_kind_of_call_without_raising() -> None:
    number = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
    tools = {
        t.name: t
        for t in [
            CALCULATOR,
            Tool("slow", "sleeps", number, slow),
            Tool("slow_async", "sleeps", number, slow_async),
            Tool("broken", "fails", {"type": "object", "properties": {}}, broken),
            Tool("table", "a dict", {"type": "object", "properties": {}}, lambda: {"a": [1, 2]}),
            Tool("long", "a lot", {"type": "object", "properties": {}}, lambda: "x" * 50),
        ]
    }

    async def run(call: ToolCall) -> str:
        return await execute(call, tools, timeout_s=0.3, max_chars=20)

    def answer(call: ToolCall) -> str:
        return asyncio.run(run(call))

    assert answer(ToolCall("calculate", {"expression": "(12 + 30) * 4"})) == "168"
    assert answer(ToolCall("table", {})) == '{"a": [1, 2]}'
    assert answer(ToolCall("long", {})) == "x" * 20 + " [truncated]"
    assert answer(ToolCall("nope", {})).startswith("Error: unknown tool 'nope' (available: broken, calculate")
    assert (
        answer(ToolCall("calculate", {}))
        == "Error: the arguments is missing the required argument 'expression'"
    )
    assert answer(ToolCall(None, None, "bad JSON")) == "Error: bad JSON"
    assert answer(ToolCall("broken", {})) == "Error: RuntimeError: the database is down"
    assert answer(ToolCall("calculate", {"expression": "1/0"})) == "Error: ValueError: division by zero"
    for name in ("slow", "slow_async"):
        start = time.perf_counter()
        assert answer(ToolCall(name, {"seconds": 2})) == f"Error: tool '{name}' did not finish within 0.3 s"
        assert time.perf_counter() - start < 1.5


async def lookup() -> str:
    """A tool with a shorter timeout of its own, whose error names what it waited for."""
    try:
        await asyncio.wait_for(asyncio.Event().wait(), 0.05)
    except TimeoutError:
        raise TimeoutError("the index at 127.0.0.1:9 did not answer within 0.05 s") from None
    return "found"


def lookup_sync() -> str:
    raise TimeoutError("the index at 127.0.0.1:9 did not answer within 0.05 s")


def test_a_tools_own_timeout_is_reported_as_it_said_not_as_the_tool_timeout() -> None:
    empty = {"type": "object", "properties": {}}
    tools = {
        "lookup": Tool("lookup", "", empty, lookup),
        "lookup_sync": Tool("lookup_sync", "", empty, lookup_sync),
    }
    for name in tools:
        answer = asyncio.run(execute(ToolCall(name, {}), tools, timeout_s=5.0))
        assert answer == "Error: TimeoutError: the index at 127.0.0.1:9 did not answer within 0.05 s", name


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 30) * 4", "168"),
        ("7 / 2", "3.5"),
        ("-2 ** 3", "-8"),
        ("17 // 5 + 17 % 5", "5"),
        ("0.1 + 0.2", "0.3"),
    ],
)
def test_calculator_is_exact(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "(1).real", "x + 1", "2 ** 1000", "9 ** 9 ** 9", "1 +", "'a' * 3"],
)
def test_calculator_refuses_everything_but_arithmetic(expression: str) -> None:
    with pytest.raises(ValueError):
        calculate(expression)


def test_the_chat_template_renders_tools_calls_and_results() -> None:
    tokenizer = train_tokenizer()
    env = CalculatorEnv(CalculatorEnv.Args(num_eval_tasks=5))
    task = env.dataset("eval")[0]
    messages = [
        *env.prompt(task),
        {
            "role": "assistant",
            "content": call_text('{"name": "calculate", "arguments": {"expression": "1+1"}}'),
        },
        {"role": "tool", "name": "calculate", "content": "2"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=env.tools(task), tokenize=False, add_generation_prompt=True
    )
    assert '"name": "calculate"' in text and "<tools>" in text and text.startswith("<|im_start|>system\n")
    assert "<tool_response>\n2\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_calculator_env_scores_the_final_answer_and_counts_tool_use() -> None:
    env = load_environment("calculator", {"num_train_tasks": 200, "num_eval_tasks": 20})
    assert {t.question for t in env.dataset("train")}.isdisjoint({t.question for t in env.dataset("eval")})
    task = WordProblem("t", "arithmetic", "A farm has 12 rows of 30 apple trees.", (Fraction(360),))
    transcript: list[Message] = [
        {
            "role": "assistant",
            "content": call_text('{"name": "calculate", "arguments": {"expression": "12*30"}}'),
        },
        {"role": "tool", "name": "calculate", "content": "360"},
        {"role": "assistant", "content": call_text('{"name": "calc", "arguments": {}}')},
        {"role": "tool", "name": "calc", "content": "Error: unknown tool 'calc' (available: calculate)"},
        {"role": "assistant", "content": "So \\boxed{360}.<|im_end|>"},
    ]
    assert env.score(task, transcript) == (
        1.0,
        {"correct": 1.0, "has_boxed": 1.0, "tool_calls": 2.0, "tool_errors": 1.0},
    )
    assert env.score(task, transcript[:-1])[1]["correct"] == 0.0


def test_env_response_runs_calls_in_order_and_limits_them() -> None:
    env = CalculatorEnv(CalculatorEnv.Args(max_tool_calls=2))
    task = env.dataset("eval")[0]
    calls = "".join(
        call_text(f'{{"name": "calculate", "arguments": {{"expression": "{k}*2"}}}}') for k in range(3)
    )
    replies = asyncio.run(env.env_response(task, [{"role": "assistant", "content": calls}]))
    assert replies is not None
    assert [r["content"] for r in replies] == ["0", "2", "Error: at most 2 tool calls are run per turn"]
    assert all(r["role"] == "tool" for r in replies)
    assert asyncio.run(env.env_response(task, [{"role": "assistant", "content": "\\boxed{1}"}])) is None


class ScriptedCalls(CalculatorEnv):
    """The random tiny model never writes a tool call; this one calls the calculator for it on the
    first turns, so the whole tool loop (execution, tool messages, token stitching) runs for real."""

    def tool_calls(self, task: Any, text: str) -> list[ToolCall]:
        return [ToolCall("calculate", {"expression": "6*7"})]


def play(env: CalculatorEnv, url: str, n: int) -> list:
    async def run() -> list:
        client = InferenceClient(url, ClientConfig(request_timeout=60))
        await client.connect()
        try:
            return await env.rollout_group(env.dataset("eval")[0], client, SamplingConfig(max_tokens=12), n)
        finally:
            await client.close()

    return asyncio.run(run())


def test_tool_episodes_against_a_real_server(server: str, model: Path) -> None:
    url = server
    tokenizer = load_tokenizer(str(model))
    env = ScriptedCalls(ScriptedCalls.Args(max_turns=3, num_eval_tasks=4))
    env.setup(tokenizer, seq_len=1024)
    [trajectory] = play(env, url, 1)
    assert [m["role"] for m in trajectory.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["42", "42"]
    assert [t["tool_calls"] for t in trajectory.turns] == [1, 1, 1]
    assert trajectory.metrics["turns"] == 3.0 and trajectory.metrics["correct"] == 0.0
    # the environment's tokens (mask 0) are the template's rendering of the tool results
    env_ids = [
        i for i, m in zip(trajectory.completion_ids, trajectory.completion_mask, strict=True) if m == 0
    ]
    env_text = tokenizer.decode(env_ids, skip_special_tokens=False)
    assert env_text.count("<tool_response>\n42\n</tool_response>") == 2
    sampled = sum(trajectory.completion_mask)
    assert sampled == sum(t["completion_tokens"] for t in trajectory.turns)
    prompt = tokenizer.apply_chat_template(
        env.prompt(env.dataset("eval")[0]), tools=env.tools(None), tokenize=False, add_generation_prompt=True
    )
    assert trajectory.prompt_ids == tokenizer.encode(prompt, add_special_tokens=False)


def test_the_unscripted_environment_ends_without_tool_calls(server: str, model: Path) -> None:
    url = server
    env = CalculatorEnv(CalculatorEnv.Args(max_turns=3, num_eval_tasks=4))
    env.setup(load_tokenizer(str(model)), seq_len=1024)
    trajectories = play(env, url, 3)
    for t in trajectories:
        calls = parse_tool_calls(t.messages[0]["content"])
        assert len(t.turns) == (1 if not calls else len(t.turns)) and t.reward in (0.0, 1.0)
        assert set(t.metrics) >= {"correct", "has_boxed", "tool_calls", "tool_errors", "turns"}
