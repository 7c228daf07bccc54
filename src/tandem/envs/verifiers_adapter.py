"""Environments written for verifiers' classic API, run against tandem's inference server.

    [env]
    name = "verifiers:my_env"     # the module verifiers would load: `my_env` (or `my-env`)
    args = { difficulty = 2 }     # keyword arguments of its load_environment(...)

Needs the optional extra (`uv sync --extra verifiers`, or `pip install 'tandem[verifiers]'`):
verifiers >= 0.3, < 0.4, whose classic API (`vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.Rubric`,
datasets with `prompt`/`question` and `answer`) runs offline against any OpenAI-compatible server.

A rollout group is the verifiers environment's own `run_group`: its turn loop, stop conditions,
rubric and group rewards. Every model call goes through `TandemClient`, a verifiers client that
sends the request with tandem's client (retries; the server's token ids, logprobs and weight
versions come back on the response). Turn 0 goes through the chat endpoint; a later turn whose
messages extend the previous turn continues from the token ids already sampled
(`multi_turn.environment_ids`), so a multi-turn conversation is never re-tokenised. The
trajectory is stitched from the responses verifiers recorded in `state["trajectory"]`.

A rollout that verifiers ends with an error, or whose turns do not stitch, fails its group (the
orchestrator logs the task id and the reason and samples another task).
"""

import importlib.util
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.client.config import SamplingConfig
from tandem.client.inference import ChatResult, InferenceClient
from tandem.config.base import Section
from tandem.config.loader import ConfigError
from tandem.envs.base import Environment, RewardFunction, Split, Trajectory, Turn, stitch
from tandem.envs.multi_turn import environment_ids, render_ids

log = logging.getLogger(__name__)
SUCCESS_METRIC = "passed"
"""1.0 when the reward reaches the verifiers environment's `pass_threshold` (used for pass@k)."""
OWN_SAMPLING_KEYS = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "logprobs"}


class VerifiersRolloutError(RuntimeError):
    """verifiers ended a rollout with an error (recorded in its state, not raised)."""


@dataclass(frozen=True)
class VerifiersTask:
    task_id: str
    row: dict[str, Any]
    """The dataset row verifiers formatted: prompt, example_id, answer, info, ..."""


def require_verifiers() -> Any:
    if importlib.util.find_spec("verifiers") is None:
        raise ConfigError(
            "verifiers environments need the optional extra: uv sync --extra verifiers "
            "(or pip install 'tandem[verifiers]')"
        )
    import verifiers

    return verifiers


def load_verifiers_env(env_id: str, args: dict[str, Any]) -> Any:
    """`vf.load_environment(env_id, **args)`, keeping the process's SIGINT/SIGTERM handlers
    (verifiers installs its own when an environment is built)."""
    vf = require_verifiers()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return vf.load_environment(env_id, **args)
    except (ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"env.name: cannot load verifiers environment '{env_id}': {e}") from None
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def make_client_class() -> type:
    """TandemClient is defined once verifiers is importable (it subclasses verifiers' client)."""
    from verifiers.legacy.clients import OpenAIChatCompletionsClient
    from verifiers.legacy.errors import OverlongPromptError
    from verifiers.legacy.types import Response, ResponseMessage, ResponseTokens, Usage

    class TandemClient(OpenAIChatCompletionsClient):
        """A verifiers client over tandem's InferenceClient; message and tool conversion are
        verifiers' own (OpenAI chat format)."""

        def __init__(self, inference: InferenceClient, tokenizer: Any, budget: int | None) -> None:
            super().__init__(inference.openai)
            self.inference = inference
            self.tokenizer = tokenizer
            self.budget = budget

        async def get_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            messages = without_none(await self.to_native_prompt(prompt))
            native_tools = await self.to_native_tools(tools)
            sampling, extra = split_sampling(dict(sampling_args or {}))
            if native_tools:
                extra["tools"] = native_tools
            state = kwargs.get("state")
            previous = state["trajectory"][-1] if state and state.get("trajectory") else None
            if previous is not None:
                before = without_none(
                    await self.to_native_prompt([*previous["prompt"], *previous["completion"]])
                )
                tokens = previous["response"].message.tokens
                if tokens is not None and messages[: len(before)] == before:
                    ids = tokens.prompt_ids + tokens.completion_ids
                    new = messages[len(before) :]
                    ids += environment_ids(self.tokenizer, tokens.completion_ids, new, native_tools)
                    result = await self.inference.complete(ids, self.fit(sampling, len(ids)), **extra)
                    return self.response(result)
            prompt_len = len(render_ids(self.tokenizer, messages, native_tools))
            result = await self.inference.chat(messages, self.fit(sampling, prompt_len), n=1, **extra)
            return self.response(result)

        def fit(self, sampling: SamplingConfig, prompt_len: int) -> SamplingConfig:
            """Shrink max_tokens so prompt + answer fit the budget; a prompt that leaves no room
            ends the rollout as verifiers does for an overlong prompt."""
            if self.budget is None:
                return sampling
            room = self.budget - prompt_len
            if room < 1:
                raise OverlongPromptError(f"prompt of {prompt_len} tokens leaves no room in {self.budget}")
            return sampling.model_copy(update={"max_tokens": min(sampling.max_tokens, room)})

        def response(self, result: ChatResult) -> Any:
            choice = result.choices[0]
            prompt_ids = result.prompt_token_ids
            finish = (
                choice.finish_reason if choice.finish_reason in ("stop", "length", "tool_calls") else None
            )
            return Response(
                id="",
                created=0,
                model=self.inference.model,
                usage=Usage(
                    prompt_tokens=len(prompt_ids),
                    reasoning_tokens=0,
                    completion_tokens=len(choice.token_ids),
                    total_tokens=len(prompt_ids) + len(choice.token_ids),
                ),
                message=ResponseMessage(
                    content=choice.text,
                    finish_reason=finish,
                    is_truncated=choice.finish_reason == "length",
                    tokens=ResponseTokens(
                        prompt_ids=prompt_ids,
                        prompt_mask=[0] * len(prompt_ids),
                        completion_ids=choice.token_ids,
                        completion_mask=[1] * len(choice.token_ids),
                        completion_logprobs=choice.logprobs,
                        weight_versions=choice.weight_versions,
                    ),
                ),
            )

        async def close(self) -> None:
            """The InferenceClient belongs to the orchestrator's pool, which closes it."""

    return TandemClient


def without_none(native: tuple[list[Any], dict]) -> list[dict[str, Any]]:
    """verifiers' OpenAI-format messages without their None fields (as the server reads them)."""
    return [{k: v for k, v in dict(m).items() if v is not None} for m in native[0]]


def split_sampling(args: dict[str, Any]) -> tuple[SamplingConfig, dict[str, Any]]:
    """verifiers' sampling args → tandem's SamplingConfig plus the request's other fields."""
    limit = args.get("max_tokens") or args.get("max_completion_tokens")
    sampling = SamplingConfig(
        temperature=args.get("temperature", 1.0),
        top_p=args.get("top_p", 1.0),
        **({"max_tokens": limit} if limit else {}),
    )
    extra = {k: v for k, v in args.items() if k not in OWN_SAMPLING_KEYS | {"extra_body"} and v is not None}
    extra.update(args.get("extra_body") or {})
    return sampling, extra


def to_turn(step: dict[str, Any]) -> Turn:
    message = step["response"].message
    tokens = message.tokens
    if tokens is None:
        raise VerifiersRolloutError("a model turn has no token ids (was it sampled through TandemClient?)")
    return Turn(
        prompt_ids=list(tokens.prompt_ids),
        completion_ids=list(tokens.completion_ids),
        logprobs=list(tokens.completion_logprobs),
        weight_versions=list((tokens.model_extra or {}).get("weight_versions", [])),
        finish_reason=message.finish_reason or "stop",
    )


def plain_messages(messages: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in messages or []]


class VerifiersEnv(Environment):
    """A verifiers environment as a tandem Environment (built by `load`, not from a config)."""

    class Args(Section):
        env_id: str
        env_args: dict[str, Any] = {}

    def __init__(self, args: Args, vf_env: Any = None) -> None:
        super().__init__(args)
        self.vf_env = vf_env if vf_env is not None else load_verifiers_env(args.env_id, args.env_args)
        self.name = args.env_id.replace("-", "_").split("/")[-1]
        self.client_class = make_client_class()
        self.splits: dict[str, list[VerifiersTask]] = {}
        self.success_metric = SUCCESS_METRIC

    @classmethod
    def load(cls, env_id: str, env_args: dict[str, Any] | None = None) -> "VerifiersEnv":
        return cls(cls.Args(env_id=env_id, env_args=env_args or {}))

    @classmethod
    def wrap(cls, vf_env: Any, name: str) -> "VerifiersEnv":
        """Wrap a verifiers environment built in this process."""
        require_verifiers()
        return cls(cls.Args(env_id=name), vf_env)

    @property
    def reward_functions(self) -> list[RewardFunction]:
        """Empty: the verifiers rubric scores rollouts (its functions appear as metrics)."""
        return []

    def dataset(self, split: Split) -> Sequence[VerifiersTask]:
        if split not in self.splits:
            if (
                split == "eval"
                and self.vf_env.eval_dataset is None
                and self.vf_env.eval_dataset_source is None
            ):
                log.warning(
                    "verifiers environment %s has no eval dataset: evaluating on its training rows", self.name
                )
            rows = self.vf_env.get_dataset() if split == "train" else self.vf_env.get_eval_dataset()
            self.splits[split] = [VerifiersTask(f"{split}-{row['example_id']}", dict(row)) for row in rows]
        return self.splits[split]

    async def rollout(
        self, task: VerifiersTask, client: InferenceClient, sampling: SamplingConfig
    ) -> Trajectory:
        return (await self.rollout_group(task, client, sampling, 1))[0]

    async def rollout_group(
        self, task: VerifiersTask, client: InferenceClient, sampling: SamplingConfig, n: int
    ) -> list[Trajectory]:
        if self.tokenizer is None:
            raise RuntimeError(f"{self.name}: setup(tokenizer, seq_len) was not called")
        vf_client = self.client_class(client, self.tokenizer, self.seq_len)
        sampling_args = {k: v for k, v in self.vf_env.sampling_args.items() if k != "n"}
        sampling_args.update(
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens
        )
        outputs = await self.vf_env.run_group(
            [task.row for _ in range(n)], vf_client, client.model, sampling_args, state_columns=["trajectory"]
        )
        return [self.trajectory(task, output) for output in outputs]

    def trajectory(self, task: VerifiersTask, output: dict[str, Any]) -> Trajectory:
        error = output.get("error")
        if error:
            raise VerifiersRolloutError(f"verifiers ended the rollout with {error['error_chain_repr']}")
        reward = float(output.get("reward") or 0.0)
        metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items()}
        metrics[SUCCESS_METRIC] = float(reward >= self.vf_env.pass_threshold)
        turns = [to_turn(step) for step in output.get("trajectory") or []]
        return stitch(task.task_id, turns, plain_messages(output.get("completion")), reward, metrics)
