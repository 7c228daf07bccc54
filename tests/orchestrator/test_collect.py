"""Batch collection without a model: environments that script their rollouts exercise filtering,
crash handling, the sample format, trajectory stitching, server selection and start-up errors."""

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.cli import UserError
from tandem.client.config import ClientConfig
from tandem.client.inference import InferenceClient, ServerPool, ServerUnavailable
from tandem.config.loader import ConfigError, build_config
from tandem.envs.base import Environment, StitchError, Trajectory, Turn, stitch
from tandem.envs.registry import load_environment
from tandem.models.loading import load_tokenizer
from tandem.models.tiny import build_tiny_model
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.loop import first_step, prompt_tokens
from tandem.orchestrator.prompt_check import check_prompt_lengths, local_token_counters
from tandem.orchestrator.rollouts import RolloutCollector, RolloutsFailing
from tandem.orchestrator.tasks import step_task_order
from tandem.transport.rollouts import pack_samples, write_step


@dataclass(frozen=True)
class ScriptedTask:
    task_id: str
    kind: str  # "varied": rewards differ within a group; "flat": all equal; "crash": the env raises


class ScriptedEnv(Environment):
    """Rewards 0, 1, 2, ... within a group for 'varied' tasks; 0.5 for all of a 'flat' task."""

    name = "scripted"

    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.tasks = [ScriptedTask(f"t{i}", kind) for i, kind in enumerate(kinds)]
        self.calls: dict[str, int] = {}

    @property
    def reward_functions(self) -> list:
        return []

    def dataset(self, split: str) -> list[ScriptedTask]:
        return self.tasks

    async def rollout(self, task: ScriptedTask, client: InferenceClient, sampling: object) -> Trajectory:
        await asyncio.sleep(0.001 * (hash(task.task_id) % 5))  # finish out of order
        if task.kind == "crash":
            raise RuntimeError("scripted crash")
        k = self.calls.get(task.task_id, 0)
        self.calls[task.task_id] = k + 1
        reward = 0.5 if task.kind == "flat" else float(k)
        turn = Turn([1, 2, 3], [10 + k, 11], [-0.5, -0.25], [7], "stop")
        return stitch(task.task_id, [turn], [], reward, {"k": float(k)})


def config(tmp_path: Path, **overrides: object) -> OrchestratorConfig:
    base = {"batch_size": 8, "group_size": 4, "seq_len": 64, "micro_batch_tokens": 64, "run_dir": tmp_path}
    base["sampling"] = {"max_tokens": 8}
    return OrchestratorConfig.model_validate({**base, **overrides})


def collect(env: Environment, cfg: OrchestratorConfig, step: int = 0):
    async def run():
        pool = ServerPool(["http://127.0.0.1:9"], cfg.client)
        try:
            return await RolloutCollector(env, pool, cfg).collect(step)
        finally:
            await pool.close()

    return asyncio.run(run())


def stream(env: ScriptedEnv, cfg: OrchestratorConfig, step: int, count: int) -> list[ScriptedTask]:
    order = step_task_order(len(env.tasks), cfg.seed, step)
    return [env.tasks[next(order)] for _ in range(count)]


def test_zero_advantage_groups_are_replaced_when_filtering(tmp_path: Path) -> None:
    env = ScriptedEnv(["flat", "varied"] * 6)
    cfg = config(tmp_path, filter_zero_advantage_groups=True)
    batch = collect(env, cfg)
    assert len(batch.groups) == 2 and len(batch.trajectories) == 8
    assert all(any(a != 0 for a in g.advantages) for g in batch.groups)
    # the kept tasks are the first two varied ones of step 0's deterministic stream
    tasks = stream(env, cfg, 0, 12)
    varied = [t.task_id for t in tasks if t.kind == "varied"][:2]
    assert [g.task_id for g in batch.groups] == varied
    assert batch.filtered_groups == [t.task_id for t in tasks].index(varied[1]) - 1
    # rewards 0, 1, 2, 3 → advantages -1.5, -0.5, 0.5, 1.5
    assert sorted(batch.groups[0].advantages) == [-1.5, -0.5, 0.5, 1.5]


def test_zero_advantage_groups_are_kept_without_filtering_or_past_the_limit(tmp_path: Path) -> None:
    kept = collect(ScriptedEnv(["flat"] * 4), config(tmp_path))
    assert kept.filtered_groups == 0 and kept.zero_advantage_kept == 2
    limited = collect(
        ScriptedEnv(["flat"] * 4), config(tmp_path, filter_zero_advantage_groups=True, max_filtered_groups=3)
    )
    assert limited.filtered_groups == 3 and limited.zero_advantage_kept == 2 and len(limited.groups) == 2


def test_a_crashing_rollout_is_logged_with_its_task_and_the_step_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path)
    order = step_task_order(5, cfg.seed, 0)
    first, second = next(order), next(order)  # the first two tasks step 0 draws: make them crash
    env = ScriptedEnv(["crash" if i in (first, second) else "varied" for i in range(5)])
    with caplog.at_level(logging.ERROR):
        batch = collect(env, cfg)
    assert len(batch.groups) == 2 and batch.failed_groups == 2
    assert {g.task_id for g in batch.groups}.isdisjoint({f"t{first}", f"t{second}"})
    crashed = [f"t{first}"]
    assert any(f"task {crashed[0]} failed: RuntimeError: scripted crash" in r.message for r in caplog.records)
    with pytest.raises(RolloutsFailing, match="rollout groups failed; last: task t0: RuntimeError"):
        collect(ScriptedEnv(["crash"]), cfg)


def test_samples_carry_advantages_versions_and_pack_into_rank_files(tmp_path: Path) -> None:
    cfg = config(tmp_path, num_ranks=2)
    batch = collect(ScriptedEnv(["varied"] * 3), cfg)
    samples = batch.samples()
    assert len(samples) == 8
    for s in samples:
        assert s.prompt_ids == [1, 2, 3] and s.completion_mask == [True, True]
        assert s.policy_version == 7 and s.policy_versions == [7] and s.env == "scripted"
    assert sum(s.advantage for s in samples[:4]) == pytest.approx(0.0)
    directory = write_step(
        tmp_path, 0, pack_samples(samples, cfg.seq_len, cfg.num_ranks, cfg.micro_batch_tokens)
    )
    assert sorted(p.name for p in directory.iterdir()) == ["READY", "rank_0.bin", "rank_1.bin"]
    assert first_step(cfg.model_copy(update={"resume": True})) == 1
    with pytest.raises(UserError, match="already holds rollouts up to step 0: pass --resume"):
        first_step(cfg)


def test_stitching_masks_environment_tokens_and_refuses_drift() -> None:
    first = Turn([1, 2], [3, 4], [-0.1, -0.2], [0], "stop")
    second = Turn([1, 2, 3, 4, 9, 9], [5], [-0.3], [1], "length")
    t = stitch("x", [first, second], [], 1.0, {})
    assert t.prompt_ids == [1, 2]
    assert t.completion_ids == [3, 4, 9, 9, 5]
    assert t.completion_mask == [1, 1, 0, 0, 1]
    assert t.completion_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert t.weight_versions == [0, 1] and t.policy_version == 0 and t.truncated
    with pytest.raises(StitchError, match="turn 1's prompt tokens do not extend"):
        stitch("x", [first, Turn([1, 2, 3, 7], [5], [-0.3], [1], "stop")], [], 1.0, {})


def test_pool_hands_out_the_least_loaded_server() -> None:
    async def run() -> list[str]:
        pool = ServerPool(["http://a", "http://b", "http://c"], ClientConfig())
        seen = []
        async with pool.lease() as first, pool.lease() as second:
            seen += [first.base_url, second.base_url]
            async with pool.lease() as third:
                seen.append(third.base_url)
            async with pool.lease() as again:
                seen.append(again.base_url)  # c is free again, a and b are busy
        await pool.close()
        return seen

    assert asyncio.run(run()) == ["http://a", "http://b", "http://c", "http://c"]


def test_a_server_that_does_not_answer_is_named_after_the_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ClientConfig(max_retries=2, retry_backoff=0.05, request_timeout=2)

    async def run() -> None:
        client = InferenceClient(f"http://127.0.0.1:{port}", cfg)
        try:
            await client.connect()
        finally:
            await client.close()

    with pytest.raises(
        ServerUnavailable, match=rf"server http://127.0.0.1:{port} did not answer .* after 3 attempts"
    ):
        asyncio.run(run())


def test_requests_failing_alike_log_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Twenty requests in flight when a server goes away: one retry warning, not forty; a later
    warning of the same reason counts the ones left out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ClientConfig(max_retries=2, retry_backoff=0.05, request_timeout=2)

    async def run() -> list[BaseException | str]:
        client = InferenceClient(f"http://127.0.0.1:{port}", cfg)
        try:
            return await asyncio.gather(*(client.connect() for _ in range(20)), return_exceptions=True)
        finally:
            client.retry_warnings.window = 0.0  # the window over: the next warning reports the count
            with contextlib.suppress(ServerUnavailable):
                await client.connect()
            await client.close()

    with caplog.at_level(logging.WARNING, logger="tandem.client.inference"):
        results = asyncio.run(run())
    assert all(isinstance(r, ServerUnavailable) for r in results)
    warnings = [r.getMessage() for r in caplog.records if "GET /v1/models failed" in r.getMessage()]
    assert len(warnings) == 1 + 2, warnings  # the first of the twenty, then the last call's two
    assert f"http://127.0.0.1:{port}" in warnings[0] and "more like it" not in warnings[0]
    assert "(39 more like it in the" in warnings[1], warnings[1]


def test_bad_settings_fail_at_start_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"batch_size \(10\) must be a multiple of group_size \(4\)"):
        build_config(OrchestratorConfig, overrides=[("batch_size", 10), ("group_size", 4)])
    with pytest.raises(
        ConfigError, match=r"'group_size': Input should be greater than or equal to 2 \(got 1\)"
    ):
        build_config(OrchestratorConfig, overrides=[("batch_size", 4), ("group_size", 1)])  # no signal
    with pytest.raises(ConfigError, match="'env.args.max_lenn': Extra inputs are not permitted"):
        load_environment("reverse_text", {"max_lenn": 3})
    with pytest.raises(ConfigError, match="unknown environment 'wordel"):
        load_environment("wordel")
    model = build_tiny_model(
        out=tmp_path / "m", num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64
    )
    cfg = config(
        tmp_path, model={"name": str(model)}, seq_len=40, micro_batch_tokens=40, sampling={"max_tokens": 16}
    )
    env = load_environment("reverse_text", {"num_train_tasks": 50})
    counters = local_token_counters(str(model))  # the launcher's, without torch
    tokenizer = load_tokenizer(str(model))
    assert counters is not None and all(
        counters[0](env.prompt(t)) == prompt_tokens(tokenizer, env.prompt(t)) for t in env.dataset("train")
    )
    for check in [(), counters]:  # the orchestrator's exact check, then the launcher's
        with pytest.raises(
            UserError, match=r"seq_len 40 cannot fit one sample: prompt of task .* has \d+ tokens"
        ):
            check_prompt_lengths(env, cfg, *(check or [lambda m: prompt_tokens(tokenizer, m)]))
    # held-out prompts with eval.max_tokens, when evaluation is on (its long answers failed as
    # "more than seq_len" and the held-out mean was taken over the short ones)
    longest = max(prompt_tokens(tokenizer, env.prompt(t)) for t in env.dataset("train"))
    shapes = {"seq_len": longest + 8, "micro_batch_tokens": longest + 8, "sampling": {"max_tokens": 8}}
    evaluation = {"interval": 1, "max_tokens": longest + 7}
    check_prompt_lengths(env, config(tmp_path, **shapes, eval=evaluation | {"interval": 0}), *counters)
    for check in [(), counters]:
        with pytest.raises(UserError, match=r"prompt of task eval-[\d-]+ has \d+ tokens \+ eval.max_tokens"):
            cfg = config(tmp_path, **shapes, eval=evaluation)
            check_prompt_lengths(env, cfg, *(check or [lambda m: prompt_tokens(tokenizer, m)]))
    with pytest.raises(ConfigError, match=r"seq_len \(40\) must exceed eval.max_tokens \(40\)"):
        build_config(
            OrchestratorConfig,
            overrides=[("seq_len", 40), ("sampling.max_tokens", 8), ("eval.max_tokens", 40)],
        )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tandem.orchestrator.cli import main; main()",
            "--batch-size",
            "6",
            "--group-size",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "orchestrator: error: invalid config: batch_size (6) must be a multiple of group_size (4)"
    ]


def test_cli_names_a_server_that_does_not_answer(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    model = build_tiny_model(
        out=tmp_path / "m", num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64
    )
    args = ["--model.name", str(model), "--run-dir", str(tmp_path / "run"), "--servers", f'["{url}"]']
    args += ["--seq-len", "128", "--micro-batch-tokens", "128", "--sampling.max-tokens", "8"]
    args += ["--client.max-retries", "1", "--client.retry-backoff", "0.05"]
    result = subprocess.run(
        [sys.executable, "-c", "from tandem.orchestrator.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"orchestrator: error: inference server {url} did not answer GET /v1/models after 2 attempts"
    )


def test_a_server_with_a_shorter_context_than_seq_len_is_refused_at_connect(server: str) -> None:
    """(Started separately, such a server failed every long sample with a 400, group by group.)"""

    async def connect(seq_len: int) -> str:
        pool = ServerPool([server], ClientConfig(max_retries=0))
        try:
            return await pool.connect(seq_len)
        finally:
            await pool.close()

    assert asyncio.run(connect(256))  # the fixture's server: max_model_len 256
    with pytest.raises(
        UserError, match=r"serves a context of 256 tokens \(max_model_len\), less than seq_len 257"
    ):
        asyncio.run(connect(257))


def test_sigterm_lets_the_orchestrator_clean_up_then_exits_143(tmp_path: Path) -> None:
    """rl stops its processes with SIGTERM; the orchestrator died at once, before finishing its W&B
    run (whose last records were lost)."""
    marker = tmp_path / "cleaned"
    script = (
        "import asyncio, pathlib\n"
        "from tandem.orchestrator.cli import until_sigterm\n"
        "async def work():\n"
        "    try:\n"
        "        print('running', flush=True)\n"
        "        await asyncio.sleep(60)\n"
        "    finally:\n"
        f"        pathlib.Path({str(marker)!r}).write_text('yes')\n"
        "asyncio.run(until_sigterm(work()))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "running\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    assert marker.read_text() == "yes"
