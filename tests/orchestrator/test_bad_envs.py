"""Bad input from environments, against a real inference server: a rollout that raises, hangs past
`rollout_timeout` (in a reward function too), or returns a malformed trajectory fails its group
with a logged reason and task id; the step (and an evaluation) goes on with other tasks."""

import asyncio
import logging
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from orchestrator_helpers import serve_base_model

from tandem.client.config import SamplingConfig
from tandem.client.inference import InferenceClient, ServerPool, ServerUnavailable
from tandem.config.loader import ConfigError
from tandem.envs.base import RewardFunction
from tandem.envs.mixture import Member
from tandem.envs.reverse_text_env import ReverseTextEnv
from tandem.orchestrator import cli as orchestrator_cli
from tandem.orchestrator import rollouts
from tandem.orchestrator.cli import run_async
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.evaluation import eval_stats, run_eval
from tandem.orchestrator.loop import step_metrics
from tandem.orchestrator.rollouts import RolloutCollector, RolloutTimeout, play_group
from tandem.orchestrator.tasks import step_task_order
from tandem.transport.rollouts import pack_samples, write_step

FAULTS = {
    "raise": "RuntimeError: broken environment",
    "hang": "RolloutTimeout: no result within rollout_timeout (8s)",
    "mask": "MalformedTrajectory: 3 completion_ids but 2 mask values and 3 logprobs",
    "nan": "MalformedTrajectory: reward nan is not a finite number",
    "no_sampled": "MalformedTrajectory: completion_mask must be 0/1 with at least one sampled token",
    "too_long": "MalformedTrajectory: 400 tokens, more than seq_len 96",
    "wrong_task": "MalformedTrajectory: trajectory of task 'someone-else' returned for task",
    "bad_metric": "MalformedTrajectory: metric 'similarity' = inf is not a finite number",
    "count": "MalformedTrajectory: returned 1 trajectories, expected 2",
}
MORE_FAULTS = {  # kinds that passed the checks before and crashed the whole run when the step was written
    "own_timeout": "TimeoutError: the verifier at 127.0.0.1:9 did not answer within 0.05s",
    "tuple_ids": "MalformedTrajectory: prompt_ids must be a list, not tuple",
    "versions": "MalformedTrajectory: weight_versions [[0]] must be non-negative integers",
    "turns": "MalformedTrajectory: turns must be a list of dicts with a finish_reason",
}

SCORE_FAULTS = {  # a hang in a reward function froze every rollout; a stray CancelledError ended the run
    "reward_none": "RewardError: reward function 'faulty' returned None, not a number",
    "reward_raises": "RewardError: reward function 'faulty' raised KeyError: 'answer'",
    "reward_hangs": "RolloutTimeout: no result within rollout_timeout (8s)",
    "cancelled": "EnvironmentCancelled: the environment raised CancelledError without being cancelled",
}
RELEASE = threading.Event()
"""Set when a test ends: a reward function hanging on it returns (its thread is a daemon anyway)."""


class FaultyEnv(ReverseTextEnv):
    """Real reverse-text rollouts, broken on purpose for the tasks listed in `faults`."""

    name = "faulty"

    def __init__(self, faults: dict[str, str]) -> None:
        super().__init__(self.Args(num_train_tasks=40, num_eval_tasks=6, max_len=6))
        self.faults = faults

    @property
    def reward_functions(self) -> list[RewardFunction]:
        def faulty(task: Any, messages: list) -> Any:
            fault = self.faults.get(task.task_id)
            if fault == "reward_none":
                return None
            if fault == "reward_raises":
                raise KeyError("answer")
            if fault == "reward_hangs":  # a verifier stuck in a loop: holds its thread, not the others
                RELEASE.wait(60)
            return 0.0

        return [*super().reward_functions, RewardFunction("faulty", faulty, 0.0)]

    async def rollout_group(
        self, task: Any, client: InferenceClient, sampling: SamplingConfig, n: int
    ) -> list:
        fault = self.faults.get(task.task_id)
        if fault == "raise":
            raise RuntimeError("broken environment")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "cancelled":  # awaits something cancelled elsewhere (its group was not)
            cancelled = asyncio.get_running_loop().create_future()
            cancelled.cancel()
            await cancelled
        if fault == "own_timeout":  # a timeout of the environment's own, well inside rollout_timeout
            try:
                await asyncio.wait_for(asyncio.Event().wait(), 0.05)
            except TimeoutError:
                raise TimeoutError("the verifier at 127.0.0.1:9 did not answer within 0.05s") from None
        trajectories = await super().rollout_group(task, client, sampling, n)
        t = trajectories[-1]
        t.completion_ids, t.completion_logprobs, t.completion_mask = [5, 6, 7], [-1.0] * 3, [1] * 3
        if fault == "mask":
            t.completion_mask = [1, 1]
        elif fault == "nan":
            t.reward = math.nan
        elif fault == "no_sampled":
            t.completion_mask = [0, 0, 0]
        elif fault == "too_long":
            t.prompt_ids = [1] * 397
        elif fault == "wrong_task":
            t.task_id = "someone-else"
        elif fault == "bad_metric":
            t.metrics["similarity"] = math.inf
        elif fault == "count":
            return trajectories[:1]
        elif fault == "tuple_ids":
            t.prompt_ids = tuple(t.prompt_ids)  # type: ignore[assignment]
        elif fault == "versions":
            t.weight_versions = [t.weight_versions]  # type: ignore[list-item]
        elif fault == "turns":
            t.turns = [{"completion_tokens": 3}]
        return trajectories


def config(server: str, tmp_path: Path, **overrides: object) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "batch_size": 4,
            "group_size": 2,
            "seq_len": 96,
            "micro_batch_tokens": 96,
            "run_dir": tmp_path,
            "servers": [server],
            "sampling": {"max_tokens": 8},
            "rollout_timeout": 8.0,
            **overrides,
        }
    )


@pytest.mark.parametrize(
    "table", [FAULTS, MORE_FAULTS, SCORE_FAULTS], ids=["faults", "more_faults", "score_faults"]
)
def test_broken_rollouts_fail_their_group_with_task_and_reason_and_the_step_goes_on(
    table: dict[str, str], server: str, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    serve_base_model(server, tiny_model, tmp_path / "base")
    cfg = config(server, tmp_path)
    order = step_task_order(40, cfg.seed, 0)
    drawn = [f"train-0-{next(order)}" for _ in range(len(table) + 2)]
    faults = dict(zip(drawn, table, strict=False))  # the first tasks step 0 draws are broken
    env = FaultyEnv(faults)
    assert all(t in {task.task_id for task in env.dataset("train")} for t in drawn)

    async def collect() -> Any:
        pool = ServerPool(cfg.servers, cfg.client)
        try:
            await pool.connect()
            return await RolloutCollector(env, pool, cfg).collect(0)
        finally:
            await pool.close()

    RELEASE.clear()
    with caplog.at_level(logging.ERROR):
        try:
            batch = asyncio.run(collect())
        finally:
            RELEASE.set()
    assert batch.failed_groups == len(table) and len(batch.errors) == len(table)
    assert sorted(g.task_id for g in batch.groups) == sorted(drawn[-2:])  # the next two tasks
    logged = "\n".join(r.message for r in caplog.records)
    for task_id, fault in faults.items():
        assert f"step 0: rollout of task {task_id} failed: {table[fault]}" in logged, fault
    assert batch.seconds < 30
    write_step(tmp_path, 0, pack_samples(batch.samples(), cfg.seq_len, 1, cfg.micro_batch_tokens))
    assert step_metrics(batch, 0.0, 1.0)["groups_failed"] == len(table)


def test_reward_functions_run_on_a_thread_of_their_own_unless_the_environment_asks_for_the_main_one() -> None:
    """Off the event loop by default (a stuck one holds up only its rollout); on the main thread
    for reward functions that need it (signal-based timeouts, as math_verify's)."""
    threads: list[threading.Thread] = []

    class Recording(FaultyEnv):
        @property
        def reward_functions(self) -> list[RewardFunction]:
            return [
                RewardFunction(
                    "where", lambda task, messages: threads.append(threading.current_thread()) or 1.0
                )
            ]

    env = Recording({})
    task = env.dataset("train")[0]
    conversations = [[{"role": "assistant", "content": "x"}]] * 2

    assert asyncio.run(env.score_all(task, conversations)) == [(1.0, {"where": 1.0})] * 2
    assert len(threads) == 2 and threading.main_thread() not in threads
    threads.clear()
    env.score_on_main_thread = True
    assert asyncio.run(env.score_all(task, conversations)) == [(1.0, {"where": 1.0})] * 2
    assert threads == [threading.main_thread()] * 2


def test_a_group_that_is_cancelled_stays_cancelled() -> None:
    """Only an environment's own CancelledError fails its group: cancelling the group (the step
    ending, SIGTERM) still cancels it."""
    env = FaultyEnv({"train-0-0": "hang"})

    async def main() -> None:
        group = asyncio.ensure_future(
            play_group(env, env.dataset("train")[0], None, SamplingConfig(max_tokens=8), 2, 60.0, 96)  # type: ignore[arg-type]
        )
        await asyncio.sleep(0.1)
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group

    asyncio.run(main())


class Stubborn(FaultyEnv):
    """Catches CancelledError and sleeps on (a retry loop that catches everything), until released."""

    name = "stubborn"

    def __init__(self) -> None:
        super().__init__({})
        self.released = False
        self.cancellations = 0

    async def rollout_group(
        self, task: Any, client: InferenceClient, sampling: SamplingConfig, n: int
    ) -> list:
        while not self.released:
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                self.cancellations += 1
        raise RuntimeError("released")


GRACE_S = 0.5
"""CANCEL_GRACE_S in these tests (5 s in a run)."""


def abandoned_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_environment_that_ignores_cancellation_fails_its_group_at_the_timeout_and_is_abandoned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the rollout timeout's cancellation was swallowed and play_group waited forever: the
    step never finished and the run hung without a word."""
    monkeypatch.setattr(rollouts, "CANCEL_GRACE_S", GRACE_S)
    env = Stubborn()
    task = env.dataset("train")[0]

    async def main() -> None:
        began = time.monotonic()
        group = asyncio.ensure_future(
            play_group(env, task, None, SamplingConfig(max_tokens=8), 2, 0.2, 96)  # type: ignore[arg-type]
        )
        try:
            await asyncio.wait([group], timeout=0.2 + GRACE_S + 2.0)
            assert group.done(), "play_group still waits for an environment that ignores cancellation"
            seconds = time.monotonic() - began
            with pytest.raises(RolloutTimeout) as raised:
                group.result()
            assert str(raised.value) == (
                "no result within rollout_timeout (0.2s), and the environment ignored cancellation: "
                "its rollout still ran 0.5s after being cancelled and was abandoned"
            )
            assert 0.2 + GRACE_S <= seconds < 0.2 + GRACE_S + 2.0
            assert env.cancellations == 1
            assert len(rollouts.ABANDONED) == 1  # still running, and referenced
            (abandoned,) = rollouts.ABANDONED
            assert abandoned.get_name() == f"rollout of env stubborn task {task.task_id}"
        finally:
            env.released = True
            await asyncio.wait([group, *rollouts.ABANDONED], timeout=5)
        assert not rollouts.ABANDONED  # let go once it ended on its own

    with caplog.at_level(logging.INFO, logger=rollouts.__name__):
        asyncio.run(main())
    (warning,) = abandoned_warnings(caplog)
    assert re.fullmatch(
        rf"environment stubborn ignored cancellation: its rollout of task {task.task_id} still runs "
        r"0\.\ds after being cancelled and is abandoned \(.*\)",
        warning,
    ), warning
    assert f"the abandoned rollout of env stubborn task {task.task_id} ended" in caplog.messages


def test_a_group_cancelled_from_outside_does_not_wait_for_an_environment_that_ignores_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Tearing a step down (a failure, SIGTERM) cancels its groups and waits for them: before, one
    environment that swallowed the cancellation kept the teardown, and the run, waiting forever."""
    monkeypatch.setattr(rollouts, "CANCEL_GRACE_S", GRACE_S)
    env = Stubborn()
    task = env.dataset("train")[0]

    async def main() -> None:
        group = asyncio.ensure_future(
            play_group(env, task, None, SamplingConfig(max_tokens=8), 2, 60.0, 96)  # type: ignore[arg-type]
        )
        try:
            await asyncio.sleep(0.1)
            began = time.monotonic()
            group.cancel()
            await asyncio.wait([group], timeout=GRACE_S + 2.0)
            assert group.done(), "the cancelled group still waits for its environment"
            assert GRACE_S <= time.monotonic() - began < GRACE_S + 2.0
            assert group.cancelled()  # cancelled it stays
            assert env.cancellations == 1 and len(rollouts.ABANDONED) == 1
        finally:
            env.released = True
            await asyncio.wait([group, *rollouts.ABANDONED], timeout=5)

    with caplog.at_level(logging.WARNING, logger=rollouts.__name__):
        asyncio.run(main())
    (warning,) = abandoned_warnings(caplog)
    assert warning.startswith(
        f"environment stubborn ignored cancellation: its rollout of task {task.task_id}"
    )


def test_an_environment_cleaning_up_after_cancellation_gets_its_grace_even_when_cancelled_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A second cancellation (the shutdown cancels every task once more) must not cut the grace
    short and report an environment that is merely cleaning up as one that ignores cancellation."""
    monkeypatch.setattr(rollouts, "CANCEL_GRACE_S", 2.0)
    cleaned: list[str] = []

    class CleansUp(FaultyEnv):
        async def rollout_group(
            self, task: Any, client: InferenceClient, sampling: SamplingConfig, n: int
        ) -> list:
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0.3)  # closing a sandbox, say
                cleaned.append(task.task_id)
            return []

    env = CleansUp({})
    task = env.dataset("train")[0]

    async def main() -> None:
        group = asyncio.ensure_future(
            play_group(env, task, None, SamplingConfig(max_tokens=8), 2, 60.0, 96)  # type: ignore[arg-type]
        )
        await asyncio.sleep(0.1)
        group.cancel()
        await asyncio.sleep(0.05)
        group.cancel()
        await asyncio.wait([group], timeout=5)
        assert group.cancelled()

    with caplog.at_level(logging.WARNING, logger=rollouts.__name__):
        asyncio.run(main())
    assert cleaned == [task.task_id]
    assert abandoned_warnings(caplog) == [] and not rollouts.ABANDONED


def test_the_process_end_does_not_wait_for_an_abandoned_rollout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncio.run cancels the tasks still running at its end and waits for them without limit:
    an abandoned rollout kept a finished orchestrator (or evaluate) from ever exiting."""
    monkeypatch.setattr(rollouts, "CANCEL_GRACE_S", 0.2)
    monkeypatch.setattr(orchestrator_cli, "SHUTDOWN_GRACE_S", 0.3)
    env = Stubborn()
    task = env.dataset("train")[0]

    async def main() -> str:
        with pytest.raises(RolloutTimeout, match="the environment ignored cancellation"):
            await play_group(env, task, None, SamplingConfig(max_tokens=8), 2, 0.1, 96)  # type: ignore[arg-type]
        return "finished"

    returned: list[str] = []
    runs = threading.Thread(target=lambda: returned.append(run_async(main())), daemon=True)
    with caplog.at_level(logging.WARNING):
        runs.start()
        runs.join(timeout=10)
    try:
        assert not runs.is_alive(), "the loop's shutdown waits for the abandoned rollout"
        assert returned == ["finished"]
        assert (
            f"exiting without 1 task(s) that ignored cancellation for 0.3s: rollout of env stubborn "
            f"task {task.task_id}" in caplog.messages
        )
    finally:
        env.released = True  # (its loop is closed: the task stays behind, never to run again)


@pytest.mark.parametrize("fault", ["empty", "unreadable"])
def test_a_training_split_that_is_empty_or_cannot_load_stops_the_orchestrator_at_start(
    fault: str, tmp_path: Path
) -> None:
    """Before, an empty split passed the start and stopped the run at step 0's first group with
    'ValueError: the training split is empty' (no environment named); a dataset that raised was a
    traceback."""

    class NoTasks(FaultyEnv):
        def dataset(self, split: str) -> list:  # type: ignore[override]
            if fault == "unreadable":
                raise FileNotFoundError(2, "No such file or directory", "data/train.jsonl")
            return []

    reason = {
        "empty": "its training split is empty",
        "unreadable": "cannot load its training split: FileNotFoundError: [Errno 2] No such file or "
        "directory: 'data/train.jsonl'",
    }[fault]
    members = [Member("reverse_text", FaultyEnv({})), Member("faulty", NoTasks({}))]
    with pytest.raises(ConfigError) as raised:
        RolloutCollector(members, None, config("http://127.0.0.1:9", tmp_path))  # type: ignore[arg-type]
    assert str(raised.value) == f"env faulty: {reason}"


@pytest.mark.parametrize("job", ["step", "eval"])
def test_a_server_that_stops_answering_stops_the_run_naming_the_rollout(job: str, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = config(url, tmp_path, client={"max_retries": 0})

    async def run_job() -> None:
        pool = ServerPool(cfg.servers, cfg.client)
        try:
            if job == "step":
                await RolloutCollector(FaultyEnv({}), pool, cfg).collect(0)
            else:
                members = [Member("faulty", FaultyEnv({}))]
                await run_eval(members, pool, 1, SamplingConfig(max_tokens=8), 1, 5.0, 96)
        finally:
            await pool.close()

    with pytest.raises(ServerUnavailable) as raised:
        asyncio.run(run_job())
    where = (
        r"step 0: rollout of task train-0-\d+"
        if job == "step"
        else r"eval rollout of env faulty task eval-0-\d+"
    )
    assert re.fullmatch(
        rf"{where}: inference server {url} did not answer a chat completion after 1 attempts: .*",
        str(raised.value),
    ), raised.value


def test_an_evaluation_counts_broken_tasks_as_failed_and_scores_the_rest(server: str, tmp_path: Path) -> None:
    cfg = config(server, tmp_path)
    env = FaultyEnv({"eval-0-1": "raise", "eval-0-4": "nan"})
    members = [Member("faulty", env)]

    async def evaluate() -> list:
        pool = ServerPool(cfg.servers, cfg.client)
        try:
            await pool.connect()
            return await run_eval(members, pool, 6, SamplingConfig(temperature=0.0, max_tokens=8), 1, 5.0, 96)
        finally:
            await pool.close()

    results = asyncio.run(evaluate())
    failed = {r.task_id: r.error for r in results if r.error}
    assert failed == {
        "eval-0-1": "RuntimeError: broken environment",
        "eval-0-4": "MalformedTrajectory: reward nan is not a finite number",
    }
    stats = eval_stats(members, results, n=1)
    assert stats["eval/num_tasks"] == 6 and stats["eval/failed"] == 2
    assert stats["eval/env/faulty/num_samples"] == 4
