"""Request bodies of the OpenAI-compatible API, validated by pydantic.

This module imports nothing but pydantic, so the vLLM proxy can validate requests with the same
models. Checks that need the model (context length, vocabulary, `max_n`) happen in the server.
Field names follow OpenAI, plus vLLM's extensions that RL clients rely on (`top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`, `return_token_ids`, `return_tokens_as_token_ids`, ...).
Unknown fields are ignored, as OpenAI and vLLM do; known features this server does not implement
are refused with a 400 when a client asks for a non-default value.
"""

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token (OpenAI's limit for chat; vLLM's default `max_logprobs`)."""

MAX_STOP_STRINGS = 256
"""Most stop strings per request. Each generated token is checked against every one of them in
the server's event loop (a stream also looks for their beginnings): 100,000 made a 200-token
stream take 13 s instead of 0.7 and held other requests up for 0.4 s at a time."""

TokenId = Annotated[StrictInt, Field(ge=0)]


MIN_TEMPERATURE = 1e-6


def usable_temperature(temperature: float | None) -> float | None:
    """0 (greedy), or high enough that the logits divided by it stay finite: near 0 they overflow
    to inf, and the sampled tokens and logprobs become NaN garbage. ValueError otherwise."""
    if temperature is not None and 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    return temperature


class APIModel(BaseModel):
    """An explicit null in a field whose default is not null means the default, as OpenAI's
    spec (every optional field is nullable) and vLLM read it: clients send `"n": null`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None
        }


class StreamOptions(APIModel):
    include_usage: bool = False


UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "prompt_logprobs": (),
}
"""Known sampling fields this server does not implement, and the values that mean "off": the only
ones accepted (null too)."""


class SamplingFields(APIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off.")
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    # Known features that are not implemented: accepted only at their neutral value.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

    _usable_temperature = field_validator("temperature")(usable_temperature)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(strings)})")
        return stop

    # Each check below is a validator of the field it refuses (not of the whole model), so that
    # the error's `param` names that field. A field's validator sees the fields declared before it.

    @field_validator(*UNIMPLEMENTED)
    @classmethod
    def _refuse_unimplemented(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value not in UNIMPLEMENTED[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and "n" in info.data and best_of != info.data["n"]:
            raise ValueError("best_of other than n is not supported by this server")
        return best_of

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream", True):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# Tried in order, token ids first: what RL clients send. Checked against list[str] first, a list
# of ids cost an error object per id, most of the time pydantic spent on a request body.
Prompt = Annotated[
    list[TokenId] | StrictStr | list[StrictStr] | list[list[TokenId]], Field(union_mode="left_to_right")
]


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one choice group each)."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Any) -> Any:
        # (a list of token ids is not looked into: it is long, and no id is empty)
        if not prompt or (isinstance(prompt[0], str | list) and not all(prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("echo", "suffix")
    @classmethod
    def _refuse_echo_and_suffix(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):  # (a list is of one kind throughout: validated so)
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(APIModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (e.g. `reasoning_content`) are kept and passed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported (got type {kind!r})")
        return content

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """OpenAI's shape, which chat templates read: {"type": "function", "function": {"name": ...}}."""
        for i, tool in enumerate(tools or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        return tools

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs", True):
            raise ValueError("top_logprobs needs logprobs to be true")
        return top_logprobs

    @field_validator("tool_choice")
    @classmethod
    def _no_forced_tool(cls, tool_choice: Any) -> Any:
        if tool_choice not in (None, "auto", "none"):
            raise ValueError("tool_choice must be 'auto' or 'none' (tool calls are returned as text)")
        return tool_choice

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, continue_final: bool, info: ValidationInfo) -> bool:
        if continue_final and info.data.get("add_generation_prompt", False):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return continue_final

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
        if response_format and response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported by this server")
        return response_format

    @property
    def completion_limit(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens, as in OpenAI's API."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; else alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class UpdateWeightsRequest(APIModel):
    """POST /update_weights: a Hugging Face safetensors directory (`path`), or policy version N of
    the run (`step`) by the server's weight transport: run_dir/weights/step_N with `filesystem`,
    received from the trainer with `broadcast` or `colocated`."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    step: int | None = Field(None, ge=0, validate_default=True)  # (checked also when absent)
    version: int | None = Field(
        None,
        ge=0,
        description="Weight version to report; default: N of a step_N directory, else current + 1.",
    )

    @field_validator("step")
    @classmethod
    def _one_source(cls, step: int | None, info: ValidationInfo) -> int | None:
        if "path" in info.data and (info.data["path"] is None) == (step is None):
            raise ValueError("give exactly one of 'path' or 'step'")
        return step


class KVExportRequest(APIModel):
    """POST /v1/kv/export: compute `prompt` and answer its reusable blocks' keys and values after
    its first `skip_tokens` (what the asking server's cache holds), as engine/kv_prefix.py writes them."""

    model_config = ConfigDict(extra="forbid")

    prompt: list[int] = Field(min_length=1)
    skip_tokens: int = Field(0, ge=0)
    staged: bool = Field(
        False, description="Answer through a staging buffer (same machine: kv_staging.py) when one is free."
    )


class KVReleaseRequest(APIModel):
    """POST /v1/kv/release: the decode server is done with the staging buffer of an export."""

    model_config = ConfigDict(extra="forbid")

    buffer: int = Field(ge=0)
    lease: int = Field(ge=0)


class KVSendRequest(KVReleaseRequest):
    """POST /v1/kv/send: send the staged export that `lease` holds over link `link`
    (engine/kv_link.py); `nbytes` is the extent of its packed blocks."""

    link: int = Field(ge=1)
    nbytes: int = Field(gt=0)


class KVUnlinkRequest(APIModel):
    """POST /v1/kv/unlink: the decode server dropped link `link`."""

    model_config = ConfigDict(extra="forbid")

    link: int = Field(ge=1)
