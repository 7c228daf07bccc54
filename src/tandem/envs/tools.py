"""Tool calling: tools with JSON schemas, `<tool_call>` parsing, execution, and `ToolEnv`.

- `Tool(name, description, parameters, fn)`: `parameters` is the JSON schema of the arguments
  object; `fn` (sync or async) is called with the arguments as keyword arguments. `Tool.schema`
  is the OpenAI function-tool format; the environment passes the list as `tools` to the chat
  endpoint and the chat template renders it (Qwen/Hermes templates: a `<tools>` block in the
  system message, tool results as `<tool_response>` in a user turn).
- `parse_tool_calls(text)`: every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a
  model turn, in order, plus an unterminated last one (the model stopped mid-call). Malformed
  JSON, a missing name or arguments that are not an object become calls with an `error`.
- `execute(call, tools, ...)`: the text of the tool message. The result (a string as is, anything
  else as JSON, cut to `max_chars`), or `Error: ...` for a malformed call, an unknown tool,
  arguments that break the schema (required keys, unknown keys, types, enums), an exception, or a
  timeout. It never raises: a bad call costs the model a turn, not the rollout.
  A sync tool runs on its own daemon thread; at the timeout its answer is abandoned but the
  thread cannot be killed, so tools that may hang should be async or run code in the sandbox.
- `ToolEnv(MultiTurnEnv)`: after each model turn, its tool calls are executed (at most
  `max_tool_calls` per turn; the rest are answered with an error) and answered as role `tool`
  messages; the episode ends when the model answers without a tool call or `max_turns` is spent.
  It asks the server for `skip_special_tokens: False` so tags that a tokenizer marks special
  (the tiny test tokenizer does) stay in the text; the end-of-turn token's text may then end the
  message content. It also sends `tool_choice: "none"`: the tools are still rendered into the
  prompt (tandem's server always, vLLM by default), but the server returns the calls as plain
  text instead of parsing them into `tool_calls` (which vLLM does, or refuses with "auto", unless
  started with a tool parser). Subclasses write `available_tools(task)` plus what every
  environment writes.
"""

import asyncio
import json
import re
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from tandem.envs.base import Message, in_daemon_thread
from tandem.envs.multi_turn import MultiTurnEnv

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments: {"type": "object", "properties": {...}, "required": [...]}."""
    fn: Callable[..., Any]

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None
    """Why the call could not be read (then name/arguments may be None)."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of one model turn, in order (see the module docstring)."""
    return [parse_call(body) for body in TOOL_CALL.findall(text)]


def parse_call(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except (ValueError, RecursionError) as e:  # nesting past the parser's depth raises RecursionError
        return ToolCall(None, None, f"the tool call is not valid JSON ({type(e).__name__}: {str(e)[:200]})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall(None, None, 'a tool call must be a JSON object with a "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ToolCall(call["name"], None, "the arguments string is not valid JSON")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], None, '"arguments" must be a JSON object')
    return ToolCall(call["name"], arguments)


def check_value(schema: dict[str, Any], value: Any, where: str) -> str | None:
    """The first way `value` breaks the (subset of JSON) `schema`, or None."""
    expected = schema.get("type")
    if expected is not None:
        kinds = expected if isinstance(expected, list) else [expected]
        ok = any(
            isinstance(value, JSON_TYPES.get(k, object))
            and not (k in ("integer", "number") and isinstance(value, bool))
            for k in kinds
        )
        if not ok:
            return f"{where} must be of type {' or '.join(kinds)}, not {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{where} is missing the required argument '{key}'"
        for key, item in value.items():
            if key not in properties:
                return f"{where} has an unknown argument '{key}'"
            problem = check_value(properties[key], item, f"argument '{key}'")
            if problem:
                return problem
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problem = check_value(schema["items"], item, f"{where}[{i}]")
            if problem:
                return problem
    return None


async def execute(
    call: ToolCall, tools: dict[str, Tool], timeout_s: float = 5.0, max_chars: int = 1000
) -> str:
    """Run one call; returns the tool message's text and never raises (see the module docstring)."""
    if call.error is not None:
        return f"Error: {call.error}"
    tool = tools.get(call.name or "")
    if tool is None:
        return f"Error: unknown tool '{call.name}' (available: {', '.join(sorted(tools)) or 'none'})"
    problem = check_value(tool.parameters, call.arguments, "the arguments")
    if problem:
        return f"Error: {problem}"
    arguments = call.arguments or {}
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            if asyncio.iscoroutinefunction(tool.fn):
                result = await tool.fn(**arguments)
            else:
                result = await in_daemon_thread(lambda: tool.fn(**arguments), f"tool-{tool.name}")
    except Exception as e:  # a TimeoutError of the tool's own (deadline not expired) keeps its message
        if isinstance(e, TimeoutError) and deadline.expired():
            return f"Error: tool '{tool.name}' did not finish within {timeout_s:g} s"
        return f"Error: {type(e).__name__}: {e}"
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    return text if len(text) <= max_chars else text[:max_chars] + " [truncated]"


def count_tool_calls(task: Any, messages: list[Message]) -> float:
    """Tool calls the model made in the episode (a metric)."""
    return float(
        sum(len(parse_tool_calls(m.get("content") or "")) for m in messages if m.get("role") == "assistant")
    )


def count_tool_errors(task: Any, messages: list[Message]) -> float:
    """Tool messages that report an error (a metric)."""
    return float(
        sum(1 for m in messages if m.get("role") == "tool" and m.get("content", "").startswith("Error:"))
    )


class ToolEnv(MultiTurnEnv):
    """A multi-turn environment whose environment turns answer the model's tool calls."""

    class Args(MultiTurnEnv.Args):
        tool_timeout_s: float = Field(5.0, gt=0, description="Seconds one tool call may take.")
        max_tool_calls: int = Field(
            4, gt=0, description="Tool calls executed per model turn; more get an error."
        )
        max_result_chars: int = Field(1000, gt=0, description="Longest tool result passed back to the model.")

    @abstractmethod
    def available_tools(self, task: Any) -> list[Tool]:
        """The tools offered for `task`."""

    def tools(self, task: Any) -> list[dict] | None:
        return [tool.schema for tool in self.available_tools(task)] or None

    def request_extra(self, task: Any) -> dict[str, Any]:
        return {"skip_special_tokens": False, "tool_choice": "none"}

    def tool_calls(self, task: Any, text: str) -> list[ToolCall]:
        """The calls in one model turn (override to read another format)."""
        return parse_tool_calls(text)

    async def env_response(self, task: Any, messages: list[Message]) -> list[Message] | None:
        calls = self.tool_calls(task, messages[-1].get("content") or "")
        if not calls:
            return None  # a final answer
        a = self.args
        tools = {tool.name: tool for tool in self.available_tools(task)}
        limit_error = ToolCall(None, None, f"at most {a.max_tool_calls} tool calls are run per turn")
        results = await asyncio.gather(
            *(
                execute(
                    call if k < a.max_tool_calls else limit_error, tools, a.tool_timeout_s, a.max_result_chars
                )
                for k, call in enumerate(calls)
            )
        )
        return [
            {"role": "tool", "name": call.name or "", "content": result}
            for call, result in zip(calls, results, strict=True)
        ]

    def turn_info(self, task: Any, messages: list[Message]) -> dict[str, Any]:
        return {"tool_calls": len(self.tool_calls(task, messages[-1].get("content") or ""))}
