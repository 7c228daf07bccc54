"""The verifiers adapter, offline: an environment written for verifiers' classic API (defined in
this file, written as a module the way environment packages are installed, with an in-memory
dataset and a simple rubric) played against a real tandem inference server serving a tiny model."""

import asyncio
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers", reason="needs the optional extra: uv sync --extra verifiers")

from tandem.client.config import ClientConfig, SamplingConfig  # noqa: E402
from tandem.client.inference import ServerPool  # noqa: E402
from tandem.config.loader import ConfigError  # noqa: E402
from tandem.envs.mixture import Member  # noqa: E402
from tandem.envs.multi_turn import render_ids  # noqa: E402
from tandem.envs.registry import load_environment  # noqa: E402
from tandem.envs.verifiers_adapter import VerifiersEnv, VerifiersRolloutError  # noqa: E402
from tandem.models.loading import load_tokenizer  # noqa: E402
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.evaluation import eval_stats, run_eval  # noqa: E402
from tandem.orchestrator.rollouts import RolloutCollector  # noqa: E402
from tandem.orchestrator.tasks import step_task_order  # noqa: E402

MODULE = "tandem_vf_test_env"
SEQ_LEN = 256
ENV_SOURCE = '''
import verifiers as vf
from datasets import Dataset

LETTERS = "abcdefghij"


def contains_answer(parser, completion, answer) -> float:
    return float(answer in (parser.parse_answer(completion) or ""))


def answer_length(parser, completion) -> float:
    return float(len(parser.parse_answer(completion) or ""))


class Again(vf.MultiTurnEnv):
    """Asks the model to try again after each answer; raises on the task whose answer is `fail_on`."""

    def __init__(self, fail_on=None, fail_with_vf_error=False, **kwargs):
        super().__init__(**kwargs)
        self.fail_on = fail_on
        self.fail_with_vf_error = fail_with_vf_error

    async def env_response(self, messages, state, **kwargs):
        if state["answer"] == self.fail_on:
            if self.fail_with_vf_error:
                raise vf.Error("the environment gave up")
            raise RuntimeError("the environment exploded")
        return [vf.UserMessage(content=f"Again, turn {len(state['trajectory'])}.")]


def load_environment(num_examples=6, max_turns=1, fail_on=None, fail_with_vf_error=False):
    rows = [{"question": f"Write the letter {c}.", "answer": c} for c in LETTERS[:num_examples]]
    rubric = vf.Rubric(funcs=[contains_answer, answer_length], weights=[1.0, 0.0])
    data = dict(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:3]), rubric=rubric)
    if max_turns == 1:
        return vf.SingleTurnEnv(**data)
    return Again(fail_on=fail_on, fail_with_vf_error=fail_with_vf_error, max_turns=max_turns, **data)
'''


@pytest.fixture(scope="module")
def env_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The environment as an importable module, as `uv pip install <env package>` would provide."""
    directory = tmp_path_factory.mktemp("vf_env")
    (directory / f"{MODULE}.py").write_text(ENV_SOURCE)
    sys.path.insert(0, str(directory))
    yield MODULE
    sys.path.remove(str(directory))
    sys.modules.pop(MODULE, None)


def load(env_module: str, model: Path, **args: Any) -> VerifiersEnv:
    env = load_environment(f"verifiers:{env_module}", args)
    assert isinstance(env, VerifiersEnv)
    env.setup(load_tokenizer(str(model)), SEQ_LEN)
    return env


def play(server: str, env: VerifiersEnv, task: Any, sampling: SamplingConfig, n: int) -> list:
    async def run() -> list:
        pool = ServerPool([server], ClientConfig(max_retries=0))
        await pool.connect()
        try:
            async with pool.lease() as client:
                return await env.rollout_group(task, client, sampling, n)
        finally:
            await pool.close()

    return asyncio.run(run())


def test_single_turn_rollouts_carry_the_servers_token_ids_and_the_rubrics_rewards(
    server: str, model: Path, env_module: str
) -> None:
    env = load(env_module, model, num_examples=4)
    tokenizer = env.tokenizer
    assert env.name == MODULE and [t.task_id for t in env.dataset("train")] == [
        f"train-{i}" for i in range(4)
    ]
    assert [t.row["answer"] for t in env.dataset("eval")] == ["a", "b", "c"]
    task = env.dataset("train")[1]
    trajectories = play(server, env, task, SamplingConfig(temperature=1.0, max_tokens=12), n=3)
    assert len(trajectories) == 3
    prompt = [{"role": "user", "content": "Write the letter b."}]
    for t in trajectories:
        assert t.task_id == "train-1" and t.prompt_ids == render_ids(tokenizer, prompt)
        assert 1 <= len(t.completion_ids) <= 12 and t.completion_mask == [1] * len(t.completion_ids)
        assert len(t.completion_logprobs) == len(t.completion_ids) and max(t.completion_logprobs) <= 0
        assert t.weight_versions == [0] and len(t.turns) == 1
        text = tokenizer.decode(t.completion_ids, skip_special_tokens=True)
        assert t.messages[-1] == {"role": "assistant", "content": text}
        assert t.reward == float("b" in text) == t.metrics["contains_answer"]
        assert t.metrics["answer_length"] == len(text) and t.metrics["passed"] == float(t.reward >= 0.5)

    # greedy through the adapter gives exactly what the server gives a direct request
    [greedy] = play(server, env, task, SamplingConfig(temperature=0.0, max_tokens=12), n=1)

    async def direct() -> Any:
        pool = ServerPool([server], ClientConfig())
        await pool.connect()
        try:
            return await pool.clients[0].chat(prompt, SamplingConfig(temperature=0.0, max_tokens=12))
        finally:
            await pool.close()

    reference = asyncio.run(direct()).choices[0]
    assert greedy.completion_ids == reference.token_ids
    assert greedy.completion_logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_multi_turn_rollouts_are_stitched_from_token_ids_with_environment_tokens_masked(
    server: str, model: Path, env_module: str
) -> None:
    env = load(env_module, model, max_turns=3)
    tokenizer = env.tokenizer
    trajectories = play(server, env, env.dataset("train")[0], SamplingConfig(max_tokens=8), n=2)
    for t in trajectories:
        assert [m["role"] for m in t.messages] == ["assistant", "user", "assistant", "user", "assistant"]
        assert len(t.turns) == 3 and t.metrics["num_turns"] == 3
        # environment tokens: mask 0, logprob 0, and they are the template's rendering of the reply
        start = 0
        for k, turn in enumerate(t.turns):
            start += turn["env_tokens"]
            env_ids = t.completion_ids[start - turn["env_tokens"] : start]
            assert t.completion_mask[start - turn["env_tokens"] : start] == [0] * turn["env_tokens"]
            if k > 0:
                assert f"Again, turn {k}." in tokenizer.decode(env_ids)
                assert all(lp == 0.0 for lp in t.completion_logprobs[start - turn["env_tokens"] : start])
            sampled = t.completion_ids[start : start + turn["completion_tokens"]]
            assert t.completion_mask[start : start + len(sampled)] == [1] * len(sampled)
            assert tokenizer.decode(sampled, skip_special_tokens=True) == t.messages[2 * k]["content"]
            start += turn["completion_tokens"]
        assert start == len(t.completion_ids) and t.num_tokens <= SEQ_LEN


def test_a_failing_verifiers_environment_fails_its_group_and_the_step_goes_on(
    server: str, model: Path, env_module: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = OrchestratorConfig.model_validate(
        {
            "batch_size": 4,
            "group_size": 2,
            "seq_len": SEQ_LEN,
            "micro_batch_tokens": SEQ_LEN,
            "run_dir": tmp_path,
        }
        | {"sampling": {"max_tokens": 6}, "servers": [server]}
    )
    first = next(step_task_order(5, cfg.seed, 0))  # the first task step 0 draws: make it fail
    failing = "abcde"[first]
    for vf_error, reason in [
        (False, "RuntimeError: the environment exploded"),
        (True, "the environment gave up"),
    ]:
        env = load(
            env_module, model, num_examples=5, max_turns=2, fail_on=failing, fail_with_vf_error=vf_error
        )
        with pytest.raises(
            RuntimeError if not vf_error else VerifiersRolloutError, match=reason.split(": ")[-1]
        ):
            play(server, env, env.dataset("train")[first], SamplingConfig(max_tokens=6), n=2)

        async def collect(env: VerifiersEnv) -> Any:
            pool = ServerPool([server], cfg.client)
            await pool.connect()
            try:
                return await RolloutCollector(env, pool, cfg).collect(0)
            finally:
                await pool.close()

        caplog.clear()
        with caplog.at_level(logging.ERROR):
            batch = asyncio.run(collect(env))
        assert len(batch.groups) == 2 and batch.failed_groups == 1
        assert f"train-{first}" not in {g.task_id for g in batch.groups}
        assert any(f"task train-{first} failed" in r.message and reason in r.message for r in caplog.records)


def test_evaluation_of_a_verifiers_environment_reports_pass_at_k_from_its_pass_threshold(
    server: str, model: Path, env_module: str
) -> None:
    env = load(env_module, model, num_examples=4)
    members = [Member(env.name, env)]

    async def evaluate() -> list:
        pool = ServerPool([server], ClientConfig())
        await pool.connect()
        try:
            return await run_eval(
                members, pool, 3, SamplingConfig(temperature=1.0, max_tokens=8), 4, 60.0, SEQ_LEN
            )
        finally:
            await pool.close()

    results = asyncio.run(evaluate())
    assert [r.task_id for r in results] == ["eval-0", "eval-1", "eval-2"] and all(
        r.error is None for r in results
    )
    stats = eval_stats(members, results, n=4)
    counts = [sum(t.metrics["passed"] for t in r.trajectories) for r in results]
    assert stats[f"eval/env/{MODULE}/pass@1"] == pytest.approx(sum(counts) / 12)
    assert stats[f"eval/env/{MODULE}/pass@4"] == pytest.approx(sum(c > 0 for c in counts) / 3)


def test_unknown_verifiers_environment_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot load verifiers environment 'no_such_vf_env_xyz'"):
        load_environment("verifiers:no_such_vf_env_xyz")
