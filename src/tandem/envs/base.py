"""tandem's environment protocol.

An environment gives a dataset of tasks (a train and an eval split) and plays
`rollout(task, client, sampling) -> Trajectory`: it talks to an inference server through
`client` (a thin wrapper over `openai.AsyncOpenAI`, available as `client.openai`), for one
turn or many, and scores the result with its reward functions.

A trajectory is stitched from the token ids the server reported for each model turn, never
re-tokenised: turn k's prompt must extend everything before it, and the extension (the
environment's reply, a tool result, the chat template's glue) becomes completion tokens with
loss mask 0. Only the tokens the model sampled have mask 1 and carry the sampler's logprobs.
"""

import asyncio
import contextlib
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from tandem.client.config import SamplingConfig
from tandem.client.inference import InferenceClient
from tandem.config.base import Section

Split = Literal["train", "eval"]
Message = dict[str, Any]
T = TypeVar("T")


async def gather_or_cancel(*awaitables: Awaitable[T]) -> list[T]:
    """asyncio.gather, but the first error cancels the others (and waits for them) before it is
    raised: a failed group's other episodes stop instead of running on unowned, past the
    rollout timeout, on a server lease already given back."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def in_daemon_thread(call: Callable[[], T], name: str) -> "asyncio.Future[T]":
    """Run `call` on a daemon thread of its own and await its result: the event loop stays free
    while it runs, and unlike the loop's default executor a call that never returns holds up
    neither the loop's shutdown nor the process's exit (its answer is abandoned once nobody
    awaits it; the thread cannot be killed). SystemExit and the like end only the call."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(result: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        result, error = None, None
        try:
            result = call()
        except Exception as e:
            error = e
        except BaseException as e:  # noqa: BLE001 — e.g. sys.exit() in a tool or a reward function
            error = RuntimeError(f"{type(e).__name__} raised: {e}")
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


class Task(Protocol):
    """Anything with a stable id; the environment decides the rest."""

    @property
    def task_id(self) -> str: ...


class RewardError(ValueError):
    """A reward function raised, or returned something other than a finite number."""


class StitchError(ValueError):
    """A later turn's prompt does not extend the earlier turns' tokens (re-tokenisation drift)."""


@dataclass
class Turn:
    """One model turn, as the server saw and produced it."""

    prompt_ids: list[int]
    """The whole context the server was given, earlier turns included."""
    completion_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str


@dataclass
class Trajectory:
    """One finished rollout: the tokens to train on, the reward and what produced them."""

    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    """All turns after the prompt: model tokens and environment tokens, in order."""
    completion_mask: list[int]
    """1 for tokens the model sampled (trained on), 0 for environment tokens."""
    completion_logprobs: list[float]
    """The sampler's logprob of each completion token (0.0 for environment tokens)."""
    weight_versions: list[int]
    """Distinct policy versions that sampled any of its tokens, oldest first."""
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    """The conversation after the prompt (assistant and environment messages), for logs."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """Per model turn: completion_tokens, env_tokens, finish_reason, weight_versions."""

    @property
    def policy_version(self) -> int:
        """The oldest policy version that contributed tokens (what staleness is measured from)."""
        return self.weight_versions[0] if self.weight_versions else 0

    @property
    def truncated(self) -> bool:
        return bool(self.turns) and self.turns[-1]["finish_reason"] == "length"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def stitch(
    task_id: str, turns: Sequence[Turn], messages: list[Message], reward: float, metrics: dict[str, float]
) -> Trajectory:
    """Join model turns into one trajectory; raises StitchError when a turn's prompt drifts."""
    if not turns:
        raise ValueError(f"task {task_id}: a trajectory needs at least one model turn")
    prompt = list(turns[0].prompt_ids)
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    info: list[dict[str, Any]] = []
    for k, turn in enumerate(turns):
        context = prompt + completion
        if turn.prompt_ids[: len(context)] != context:
            raise StitchError(f"task {task_id}: turn {k}'s prompt tokens do not extend the earlier turns")
        env_tokens = turn.prompt_ids[len(context) :]
        completion += env_tokens + turn.completion_ids
        mask += [0] * len(env_tokens) + [1] * len(turn.completion_ids)
        logprobs += [0.0] * len(env_tokens) + list(turn.logprobs)
        info.append(
            {
                "completion_tokens": len(turn.completion_ids),
                "env_tokens": len(env_tokens),
                "finish_reason": turn.finish_reason,
                "weight_versions": list(turn.weight_versions),
            }
        )
    return Trajectory(
        task_id=task_id,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_mask=mask,
        completion_logprobs=logprobs,
        weight_versions=sorted({v for t in turns for v in t.weight_versions}),
        reward=reward,
        metrics=metrics,
        messages=messages,
        turns=info,
    )


@dataclass(frozen=True)
class RewardFunction:
    """A named score of a finished conversation; the reward is the weighted sum of all of them.

    Weight 0 makes a function a metric only (logged, not rewarded), e.g. exact match."""

    name: str
    fn: Callable[[Any, list[Message]], float]
    """(task, completion messages) → score."""
    weight: float = 1.0


def last_content(messages: list[Message]) -> str:
    """The text of the last assistant message ('' when there is none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


class Environment(ABC):
    """Tasks, a rollout procedure and reward functions. Subclasses declare their `Args`."""

    name: str = ""
    tokenizer: Any = None
    """The policy's tokenizer, once `setup` ran (multi-turn environments render turns with it)."""
    seq_len: int | None = None
    """The longest sample (prompt + all turns) the orchestrator accepts, once `setup` ran."""
    score_on_main_thread: bool = False
    """Run the reward functions on the event loop's (main) thread rather than a thread of their
    own (`score_all`): for reward functions that need the main thread, such as those using
    signal-based timeouts (math_verify's default `parsing_timeout`/`timeout_seconds`). Then a
    reward function that hangs stops every rollout, and `rollout_timeout` cannot end it."""

    class Args(Section):
        """The environment's own settings (`[env.args]` in the orchestrator's config)."""

    def __init__(self, args: Section | None = None) -> None:
        self.args = args if args is not None else self.Args()

    def setup(self, tokenizer: Any, seq_len: int) -> None:
        """Called by the orchestrator once, before any rollout, with the policy's tokenizer and its
        `seq_len`. Override to prepare more (call super)."""
        self.tokenizer = tokenizer
        self.seq_len = seq_len

    @property
    @abstractmethod
    def reward_functions(self) -> list[RewardFunction]: ...

    @abstractmethod
    def dataset(self, split: Split) -> Sequence[Task]:
        """The tasks of a split, in a fixed order (the orchestrator shuffles training tasks)."""

    @abstractmethod
    async def rollout(self, task: Any, client: InferenceClient, sampling: SamplingConfig) -> Trajectory:
        """Play one episode of `task` against the server behind `client`."""

    async def rollout_group(
        self, task: Any, client: InferenceClient, sampling: SamplingConfig, n: int
    ) -> list[Trajectory]:
        """`n` independent episodes of one task (a seeded sampling gives each its own seed).
        Single-turn environments override this with one request of `n` choices, which lets the
        server share the prompt's KV cache."""
        return await gather_or_cancel(*(self.rollout(task, client, sampling.for_part(i)) for i in range(n)))

    def score(self, task: Any, messages: list[Message]) -> tuple[float, dict[str, float]]:
        """Weighted reward and every reward function's value (as metrics). RewardError names the
        function that raised or returned something other than a finite number (None, a string)."""
        values: dict[str, float] = {}
        for rf in self.reward_functions:
            try:
                value = rf.fn(task, messages)
            except Exception as e:
                raise RewardError(f"reward function {rf.name!r} raised {type(e).__name__}: {e}") from e
            try:
                if value is None or isinstance(value, str | bytes):
                    raise TypeError
                values[rf.name] = float(value)
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward function {rf.name!r} returned {value!r:.100}, not a number"
                ) from None
            if not math.isfinite(values[rf.name]):
                raise RewardError(f"reward function {rf.name!r} returned {value!r}, not a finite number")
        reward = sum(rf.weight * values[rf.name] for rf in self.reward_functions)
        return reward, values

    async def score_all(
        self, task: Any, conversations: Sequence[list[Message]]
    ) -> list[tuple[float, dict[str, float]]]:
        """`score` of each conversation, on a thread of its own: a slow or hanging reward function
        (a synchronous call to a judge, a verifier stuck in a loop) holds up only its rollout,
        which `rollout_timeout` then fails, instead of the event loop that every other rollout
        and the weight updates run on. Reward functions may therefore run on several threads at
        once. With `score_on_main_thread`, on the event loop's (main) thread instead."""
        if self.score_on_main_thread:
            return [self.score(task, messages) for messages in conversations]
        return await in_daemon_thread(
            lambda: [self.score(task, messages) for messages in conversations], f"score-{self.name}"
        )


class SingleTurnEnv(Environment):
    """One user prompt, one model answer, scored by the reward functions."""

    @abstractmethod
    def prompt(self, task: Any) -> list[Message]:
        """The chat messages sent to the model."""

    async def rollout(self, task: Any, client: InferenceClient, sampling: SamplingConfig) -> Trajectory:
        return (await self.rollout_group(task, client, sampling, 1))[0]

    async def rollout_group(
        self, task: Any, client: InferenceClient, sampling: SamplingConfig, n: int
    ) -> list[Trajectory]:
        result = await client.chat(self.prompt(task), sampling, n=n)
        conversations = [[{"role": "assistant", "content": choice.text}] for choice in result.choices]
        scores = await self.score_all(task, conversations)
        trajectories = []
        for choice, messages, (reward, metrics) in zip(result.choices, conversations, scores, strict=True):
            turn = Turn(
                prompt_ids=result.prompt_token_ids,
                completion_ids=choice.token_ids,
                logprobs=choice.logprobs,
                weight_versions=choice.weight_versions,
                finish_reason=choice.finish_reason,
            )
            trajectories.append(stitch(task.task_id, [turn], messages, reward, metrics))
        return trajectories
