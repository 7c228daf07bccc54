"""Multi-turn stitching: environment tokens from the chat template's glue, masks and logprobs,
budgets; against hand-made turns and a real inference server serving a tiny random model."""

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tandem.client.config import ClientConfig, SamplingConfig
from tandem.client.inference import InferenceClient
from tandem.envs.base import Message, RewardFunction, Trajectory, Turn, stitch
from tandem.envs.multi_turn import MultiTurnEnv, TemplateError, environment_ids, render_ids
from tandem.models.loading import load_tokenizer
from tandem.models.tokenizer import train_tokenizer

PROMPT: list[Message] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer()


def scripted_trajectory(
    tokenizer: Any, answers: list[tuple[list[int], str]], replies: list[str]
) -> Trajectory:
    """Turns as MultiTurnEnv builds them, from given completion ids (and finish reasons)."""
    prompt_ids = render_ids(tokenizer, PROMPT)
    turns, messages = [], []
    for k, (ids, finish) in enumerate(answers):
        turns.append(Turn(prompt_ids, ids, [-0.5] * len(ids), [0], finish))
        messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        if k < len(replies):
            reply = [{"role": "user", "content": replies[k]}]
            messages += reply
            prompt_ids = prompt_ids + ids + environment_ids(tokenizer, ids, reply)
    return stitch("t", turns, messages, 0.0, {})


def single_pass(tokenizer: Any, messages: list[Message]) -> list[int]:
    text = tokenizer.apply_chat_template([*PROMPT, *messages], tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_stitched_ids_equal_one_tokenisation_of_the_whole_conversation(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    texts = ["crane", "s l a t e!", "  two  spaces, ok?"]
    answers = [(tokenizer.encode(t, add_special_tokens=False) + [eos], "stop") for t in texts]
    answers[1] = (answers[1][0][:-1], "length")  # stopped on length: the glue must close the turn
    replies = ["c:G r:X a:Y n:X e:X", '"s l a t e!" is not one five-letter word.']
    trajectory = scripted_trajectory(tokenizer, answers, replies)
    whole = single_pass(tokenizer, trajectory.messages)
    stitched = trajectory.prompt_ids + trajectory.completion_ids
    # The single pass goes on with the template's "\n" after the last <|im_end|>; the model ended there.
    assert whole[: len(stitched)] == stitched and tokenizer.decode(whole[len(stitched) :]) == "\n"
    # The mask covers exactly the sampled ids, in order; everything else is environment glue.
    sampled = [i for i, m in zip(trajectory.completion_ids, trajectory.completion_mask, strict=True) if m]
    assert sampled == [t for ids, _ in answers for t in ids]
    assert trajectory.completion_logprobs == [-0.5 if m else 0.0 for m in trajectory.completion_mask]
    glue = [
        tokenizer.decode(environment_ids(tokenizer, ids, [{"role": "user", "content": r}]))
        for (ids, _), r in zip(answers, replies, strict=False)
    ]
    assert glue[0] == "\n<|im_start|>user\nc:G r:X a:Y n:X e:X<|im_end|>\n<|im_start|>assistant\n"
    assert glue[1].startswith("<|im_end|>\n<|im_start|>user\n")  # closes the length-cut turn
    assert [t["env_tokens"] for t in trajectory.turns][1:] == [
        len(tokenizer.encode(g, add_special_tokens=False)) for g in glue
    ]


def test_sampled_ids_that_are_not_the_canonical_tokenisation_survive_stitching(tokenizer: Any) -> None:
    """A model may sample a split the tokenizer would not make (here two single spaces where it
    merges them): the trajectory keeps the sampled ids, so it differs from a re-tokenisation of
    the same text, which is why nothing is ever re-tokenised."""
    space = tokenizer.encode(" ", add_special_tokens=False)
    assert len(tokenizer.encode("  ", add_special_tokens=False)) == 1  # '  ' is one merged token
    ids = tokenizer.encode("a", add_special_tokens=False) + space + space + [tokenizer.eos_token_id]
    trajectory = scripted_trajectory(tokenizer, [(ids, "stop"), (ids, "stop")], ["more"])
    stitched = trajectory.prompt_ids + trajectory.completion_ids
    whole = single_pass(tokenizer, trajectory.messages)
    assert whole[: len(stitched)] != stitched
    assert tokenizer.decode(stitched) + "\n" == tokenizer.decode(whole)


def test_a_template_that_rewrites_assistant_content_is_refused(tokenizer: Any) -> None:
    rewriting = train_tokenizer()
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match="verbatim"):
        environment_ids(rewriting, [5], [{"role": "user", "content": "x"}])


class EchoEnv(MultiTurnEnv):
    """The environment answers 'Turn k.' until max_turns; reward = number of model turns."""

    name = "echo"

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [RewardFunction("answers", lambda task, ms: sum(m["role"] == "assistant" for m in ms))]

    def dataset(self, split: str) -> list[Any]:
        return []

    def prompt(self, task: Any) -> list[Message]:
        return PROMPT

    async def env_response(self, task: Any, messages: list[Message]) -> list[Message] | None:
        return [{"role": "user", "content": f"Turn {len(messages) // 2 + 2}."}]

    def turn_info(self, task: Any, messages: list[Message]) -> dict[str, Any]:
        return {"answer_chars": len(messages[-1]["content"])}


class Task:
    task_id = "echo-0"


def run_group(env: MultiTurnEnv, url: str, sampling: SamplingConfig, n: int) -> list[Trajectory]:
    async def run() -> list[Trajectory]:
        client = InferenceClient(url, ClientConfig(request_timeout=60))
        try:
            await client.connect()
            return await env.rollout_group(Task(), client, sampling, n)
        finally:
            await client.close()

    return asyncio.run(run())


def segments(trajectory: Trajectory) -> list[tuple[list[int], list[int]]]:
    """(environment ids, model ids) per turn, cut by the per-turn token counts."""
    out, at = [], 0
    for info in trajectory.turns:
        env = trajectory.completion_ids[at : at + info["env_tokens"]]
        at += info["env_tokens"]
        out.append((env, trajectory.completion_ids[at : at + info["completion_tokens"]]))
        at += info["completion_tokens"]
    assert at == len(trajectory.completion_ids)
    return out


def test_real_server_rollouts_stitch_turns_with_masks_and_logprobs(server: str, model: Path) -> None:
    tokenizer = load_tokenizer(str(model))
    env = EchoEnv(EchoEnv.Args(max_turns=3))
    env.setup(tokenizer, 1024)
    trajectories = run_group(env, server, SamplingConfig(temperature=1.0, max_tokens=12), n=4)
    assert len(trajectories) == 4
    prompt_ids = render_ids(tokenizer, PROMPT)
    for t in trajectories:
        assert t.prompt_ids == prompt_ids  # the server rendered turn 0 as our tokenizer does
        assert len(t.turns) == 3 and t.reward == 3.0
        assert t.metrics == {"answers": 3.0, "turns": 3.0, "out_of_budget": 0.0}
        assistant = [m for m in t.messages if m["role"] == "assistant"]
        previous: list[int] = []
        for k, (env_ids, model_ids) in enumerate(segments(t)):
            info = t.turns[k]
            assert info["max_tokens"] == 12 and info["weight_versions"] == [0]
            assert info["answer_chars"] == len(assistant[k]["content"])
            assert 1 <= len(model_ids) <= 12
            assert (model_ids[-1] == tokenizer.eos_token_id) == (info["finish_reason"] == "stop")
            assert tokenizer.decode(model_ids, skip_special_tokens=True) == assistant[k]["content"]
            if k == 0:
                assert env_ids == []
            else:
                reply = [{"role": "user", "content": f"Turn {k + 1}."}]
                assert reply[0] in t.messages
                assert env_ids == environment_ids(tokenizer, previous, reply)
            previous = model_ids
        mask = t.completion_mask
        assert sum(mask) == sum(info["completion_tokens"] for info in t.turns)
        assert all((lp == 0.0) for lp, m in zip(t.completion_logprobs, mask, strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.completion_logprobs, mask, strict=True) if m)


def test_token_budget_shrinks_turns_and_ends_the_episode(server: str, model: Path) -> None:
    tokenizer = load_tokenizer(str(model))
    prompt_len = len(render_ids(tokenizer, PROMPT))
    budget = prompt_len + 30
    env = EchoEnv(EchoEnv.Args(max_turns=10, max_total_tokens=budget))
    env.setup(tokenizer, 1024)
    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    for t in run_group(env, server, sampling, n=3):
        assert t.num_tokens <= budget
        assert t.metrics["out_of_budget"] == 1.0 and len(t.turns) < 10
        assert t.turns[0]["max_tokens"] == 12
        used = prompt_len
        for info in t.turns:
            used += info["env_tokens"]
            assert info["max_tokens"] == min(12, budget - used)
            used += info["completion_tokens"]
    env.setup(tokenizer, prompt_len)  # seq_len bounds the episode as well
    with pytest.raises(ValueError, match="leaves no token budget"):
        run_group(env, server, sampling, n=1)


class OneCrashEnv(EchoEnv):
    """Episode 0's environment raises at its first reply; the others reply slowly, counting."""

    def __init__(self, args: MultiTurnEnv.Args) -> None:
        super().__init__(args)
        self.crashing: int | None = None
        self.replies_after_the_crash = 0
        self.crashed = False

    async def env_response(self, task: Any, messages: list[Message]) -> list[Message] | None:
        if self.crashing in (None, id(messages)):
            self.crashing = id(messages)
            self.crashed = True
            raise RuntimeError("environment bug in one episode")
        await asyncio.sleep(0.3)
        self.replies_after_the_crash += self.crashed
        return await super().env_response(task, messages)


def test_a_crashing_episode_stops_the_rest_of_its_group(server: str, model: Path) -> None:
    """The group fails with the episode's own error, and its other episodes end with it: they
    ran on unowned (past the rollout timeout, on a server lease given back)."""
    env = OneCrashEnv(OneCrashEnv.Args(max_turns=8))
    env.setup(load_tokenizer(str(model)), 1024)

    async def run() -> None:
        client = InferenceClient(server, ClientConfig(request_timeout=60))
        await client.connect()
        try:
            with pytest.raises(RuntimeError, match="environment bug in one episode"):
                await env.rollout_group(Task(), client, SamplingConfig(temperature=1.0, max_tokens=4), 4)
            await asyncio.sleep(1.0)  # the others' slow replies would have ended by now
            assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        finally:
            await client.close()

    asyncio.run(run())
    assert env.replies_after_the_crash == 0


class NoThinkingEnv(EchoEnv):
    def request_extra(self, task: Any) -> dict[str, Any]:
        return {"chat_template_kwargs": {"enable_thinking": False}}


def test_chat_template_kwargs_render_every_turn(server: str, model: Path) -> None:
    """Qwen3's enable_thinking = false opens every answer with an empty think block: the server
    renders turn 0 with it, and the later turns' glue and the first turn's budget must too (they
    were rendered without it: later turns were asked to think, turn 0's budget was too big)."""
    tokenizer = load_tokenizer(str(model))
    no_think = {"enable_thinking": False}
    opening = render_ids(tokenizer, PROMPT, None, **no_think)
    assert len(opening) > len(render_ids(tokenizer, PROMPT))  # the tiny template knows the kwarg
    env = NoThinkingEnv(NoThinkingEnv.Args(max_turns=1, max_total_tokens=len(opening) + 20))
    env.setup(tokenizer, 1024)
    [t] = run_group(env, server, SamplingConfig(temperature=1.0, max_tokens=60), n=1)
    assert t.prompt_ids == opening and t.turns[0]["max_tokens"] == 20  # the server's prompt counted
    env = NoThinkingEnv(NoThinkingEnv.Args(max_turns=3))
    env.setup(tokenizer, 1024)
    for t in run_group(env, server, SamplingConfig(temperature=1.0, max_tokens=8), n=2):
        turns = segments(t)
        assert t.prompt_ids == opening and len(turns) == 3
        for k in (1, 2):
            reply = [{"role": "user", "content": f"Turn {k + 1}."}]
            assert turns[k][0] == environment_ids(tokenizer, turns[k - 1][1], reply, None, **no_think)
            assert tokenizer.decode(turns[k][0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
