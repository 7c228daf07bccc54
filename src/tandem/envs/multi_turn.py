"""Multi-turn environments: the model and the environment take turns until the episode ends.

Subclass `MultiTurnEnv` and write four things:

    class MyEnv(MultiTurnEnv):
        name = "my_env"

        class Args(MultiTurnEnv.Args):          # keeps max_turns and max_total_tokens
            ...

        @property
        def reward_functions(self): ...         # (task, messages) -> float, as everywhere
        def dataset(self, split): ...
        def prompt(self, task): ...             # the first messages (system/user)
        async def env_response(self, task, messages): ...
            # messages: the conversation after the prompt (assistant and environment turns).
            # Return the environment's next messages (user or tool role), or None to end.

Optionally override `tools(task)` (tool schemas rendered by the chat template, for tool-calling
environments) and `turn_info(task, messages)` (extra per-turn metadata).

How a turn's tokens are made, so that nothing is re-tokenised:
- Turn 0 goes through the chat endpoint: the server renders the prompt with its chat template
  and returns the prompt ids and the sampled ids.
- Turn k > 0 goes through the completions endpoint with token ids: the previous prompt ids, the
  previous completion ids exactly as sampled, then the environment tokens. The environment
  tokens are the chat template's rendering of only the new messages plus its glue (closing the
  assistant turn, opening the next assistant turn): `environment_ids` renders a stand-in
  conversation `[user, assistant=PLACEHOLDER, *new]` and keeps the text after the placeholder.
  When the model ended its turn with the end-of-turn token, that token is already in its ids
  and is not repeated; when it stopped on length (or a stop string) the glue closes the turn.
- `stitch` joins the turns: environment tokens get loss mask 0 and logprob 0.0.
- A seeded sampling (orchestrator.seeded_sampling): turn 0's request carries the group's seed;
  turn k of choice i the seed `sampling.for_part(i).for_part(k)`, so no two requests share one.

Budgets: at most `max_turns` model turns, and every turn's `max_tokens` shrinks so the whole
sample fits `max_total_tokens` (default: the orchestrator's seq_len); when no room is left the
episode ends. A turn's sampled tokens are never cut afterwards, so a trajectory always fits.
"""

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from tandem.client.config import SamplingConfig
from tandem.client.inference import Generation, InferenceClient
from tandem.config.base import Section
from tandem.envs.base import Environment, Message, Trajectory, Turn, gather_or_cancel, stitch

PLACEHOLDER = "TandemPlaceholder7q"
"""Stands for the model's last answer when the chat template renders the glue around new messages."""


class TemplateError(ValueError):
    """The chat template cannot render environment messages as a continuation of the conversation."""


def render_ids(
    tokenizer: Any, messages: list[Message], tools: list[dict] | None = None, **template_kwargs: Any
) -> list[int]:
    """The prompt ids the chat template makes for `messages` (with the assistant generation prompt)."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def environment_ids(
    tokenizer: Any,
    last_completion_ids: Sequence[int],
    new_messages: list[Message],
    tools: list[dict] | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids between the model's last turn and its next one: the template's close of the
    assistant turn (unless the model already emitted it), `new_messages`, and the next assistant
    header. Rendered through the tokenizer's own chat template, so any ChatML/Qwen-like works;
    `template_kwargs` are the episode's chat_template_kwargs (Qwen3's enable_thinking)."""
    stand_in = [
        {"role": "user", "content": "-"},
        {"role": "assistant", "content": PLACEHOLDER},
        *new_messages,
    ]
    text = tokenizer.apply_chat_template(
        stand_in, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    if text.count(PLACEHOLDER) != 1:
        raise TemplateError("the chat template does not render an assistant message's content verbatim")
    glue = text.split(PLACEHOLDER, 1)[1]
    if last_completion_ids:
        ended_with = tokenizer.decode([last_completion_ids[-1]], skip_special_tokens=False)
        is_special = last_completion_ids[-1] in set(tokenizer.all_special_ids)
        if is_special and ended_with and glue.startswith(ended_with):
            glue = glue[len(ended_with) :]
    return tokenizer.encode(glue, add_special_tokens=False)


class MultiTurnEnv(Environment):
    """Model turns and environment messages alternate; see the module docstring."""

    class Args(Section):
        max_turns: int = Field(6, gt=0, description="Most model turns per episode.")
        max_total_tokens: int | None = Field(
            None,
            gt=0,
            description="Most tokens of one episode (prompt and all turns); default: the orchestrator's seq_len.",
        )

    @abstractmethod
    def prompt(self, task: Any) -> list[Message]:
        """The messages before the model's first turn."""

    @abstractmethod
    async def env_response(self, task: Any, messages: list[Message]) -> list[Message] | None:
        """The environment's reply to the conversation so far (after the prompt), or None to end."""

    def tools(self, task: Any) -> list[dict] | None:
        """Tool schemas the chat template renders into the prompt (None: no tools)."""
        return None

    def request_extra(self, task: Any) -> dict[str, Any]:
        """Extra fields of every generation request of an episode (e.g. tool environments ask for
        `skip_special_tokens: False` so tool-call tags survive in the text); default none. Its
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) render every turn: the server's
        turn 0, and the glue and budgets this side renders for the later ones."""
        return {}

    def turn_info(self, task: Any, messages: list[Message]) -> dict[str, Any]:
        """Extra metadata of the model turn that `messages` ends with (stored in Trajectory.turns)."""
        return {}

    @property
    def token_budget(self) -> int:
        limits = [x for x in (self.args.max_total_tokens, self.seq_len) if x is not None]
        if not limits:
            raise RuntimeError(f"{type(self).__name__}: setup(tokenizer, seq_len) was not called")
        return min(limits)

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}: setup(tokenizer, seq_len) was not called")
        return self.tokenizer

    async def rollout(self, task: Any, client: InferenceClient, sampling: SamplingConfig) -> Trajectory:
        return (await self.rollout_group(task, client, sampling, 1))[0]

    async def rollout_group(
        self, task: Any, client: InferenceClient, sampling: SamplingConfig, n: int
    ) -> list[Trajectory]:
        """Turn 0 of all `n` episodes is one chat request with n choices (shared prompt cache);
        then each episode continues on its own."""
        tokenizer = self.require_tokenizer()
        prompt = self.prompt(task)
        tools = self.tools(task)
        template_kwargs = self.request_extra(task).get("chat_template_kwargs") or {}
        prompt_len = len(render_ids(tokenizer, prompt, tools, **template_kwargs))
        first_limit = min(sampling.max_tokens, self.token_budget - prompt_len)
        if first_limit < 1:
            raise ValueError(f"task {task.task_id}: the prompt ({prompt_len} tokens) leaves no token budget")
        extra = {**self.request_extra(task), **({"tools": tools} if tools else {})}
        first = await client.chat(
            prompt, sampling.model_copy(update={"max_tokens": first_limit}), n=n, **extra
        )
        return await gather_or_cancel(
            *(
                self.continue_episode(
                    task, client, sampling.for_part(i), first.prompt_token_ids, choice, first_limit
                )
                for i, choice in enumerate(first.choices)
            )
        )

    async def continue_episode(
        self,
        task: Any,
        client: InferenceClient,
        sampling: SamplingConfig,
        prompt_ids: list[int],
        generation: Generation,
        max_tokens: int,
    ) -> Trajectory:
        tokenizer = self.require_tokenizer()
        tools = self.tools(task)
        extra = dict(self.request_extra(task))
        template_kwargs = extra.pop("chat_template_kwargs", None) or {}  # (token-id requests: no template)
        budget = self.token_budget
        messages: list[Message] = []
        turns: list[Turn] = []
        extra_info: list[dict[str, Any]] = []
        out_of_budget = False
        while True:
            turns.append(
                Turn(
                    prompt_ids=prompt_ids,
                    completion_ids=generation.token_ids,
                    logprobs=generation.logprobs,
                    weight_versions=generation.weight_versions,
                    finish_reason=generation.finish_reason,
                )
            )
            messages.append({"role": "assistant", "content": generation.text})
            extra_info.append({"max_tokens": max_tokens, **self.turn_info(task, messages)})
            if len(turns) >= self.args.max_turns:
                break
            reply = await self.env_response(task, messages)
            if not reply:
                break
            messages.extend(reply)
            context = prompt_ids + generation.token_ids
            prompt_ids = context + environment_ids(
                tokenizer, generation.token_ids, reply, tools, **template_kwargs
            )
            max_tokens = min(sampling.max_tokens, budget - len(prompt_ids))
            if max_tokens < 1:
                out_of_budget = True
                break
            turn = sampling.for_part(len(turns)).model_copy(update={"max_tokens": max_tokens})
            result = await client.complete(prompt_ids, turn, **extra)
            generation = result.choices[0]
        [(reward, metrics)] = await self.score_all(task, [messages])
        metrics["turns"] = float(len(turns))
        metrics["out_of_budget"] = float(out_of_budget)
        trajectory = stitch(task.task_id, turns, messages, reward, metrics)
        for info, extra in zip(trajectory.turns, extra_info, strict=True):
            info.update(extra)
        return trajectory
