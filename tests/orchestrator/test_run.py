"""A whole synchronous run (max_async_level 0) against a real inference server, with the test
playing the trainer: rollouts/step_0..2 on disk, every sample from the current policy, metrics and
evaluations logged; then `--resume` continues with step 3 and the same task order."""

import itertools
import json
import time
from pathlib import Path

from orchestrator_helpers import run_with_trainer, serve_base_model, served_version

from tandem.envs.registry import load_environment
from tandem.monitor.metrics import read_metrics
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.tasks import step_task_order
from tandem.transport.rollouts import read_rank, step_dir

ENV_ARGS = {"num_train_tasks": 40, "num_eval_tasks": 8, "max_len": 8}


def config(model: Path, run_dir: Path, server: str, **overrides: object) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": str(model)},
            "run_dir": run_dir,
            "max_steps": 3,
            "batch_size": 8,
            "group_size": 4,
            "num_ranks": 2,
            "seq_len": 96,
            "micro_batch_tokens": 192,
            "max_async_level": 0,
            "sampling": {"max_tokens": 12, "temperature": 1.0},
            "servers": [server],
            "env": {"args": ENV_ARGS},
            "eval": {"interval": 2, "num_tasks": 4},
            "weights": {"poll_interval": 0.05, "wait_timeout": 60},
            **overrides,
        }
    )


def expected_task_ids(cfg: OrchestratorConfig, step: int) -> list[str]:
    tasks = load_environment("reverse_text", ENV_ARGS).dataset("train")
    order = step_task_order(len(tasks), cfg.seed, step)
    return [tasks[i].task_id for i in itertools.islice(order, cfg.groups_per_step)]


def test_synchronous_run_writes_on_policy_rollouts_and_resumes(
    server: str, tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = config(tiny_model, run_dir, server)
    serve_base_model(server, tiny_model, tmp_path / "base")
    assert served_version(server) == 0
    started = time.monotonic()
    assert run_with_trainer(cfg, tiny_model, first=0) == []
    first_run_s = time.monotonic() - started

    for step in range(3):
        assert sorted(p.name for p in step_dir(run_dir, step).iterdir()) == [
            "READY",
            "rank_0.bin",
            "rank_1.bin",
        ]
        metas = [
            m for rank in range(2) for mb in read_rank(run_dir, step, rank, timeout_s=5) for m in mb.samples
        ]
        assert len(metas) == 8
        assert {m.policy_version for m in metas} == {step}, "level 0: every sample from the current policy"
        assert all(m.policy_versions == [step] for m in metas)
        assert all(m.env == "reverse_text" and m.completion_len >= 1 for m in metas)
        assert all(m.num_loss_tokens == m.completion_len for m in metas), "single turn: every token trained"
        task_ids = sorted({m.task_id for m in metas})
        assert task_ids == sorted(expected_task_ids(cfg, step))
        for task_id in task_ids:
            group = [m for m in metas if m.task_id == task_id]
            assert len(group) == 4
            mean = sum(m.reward for m in group) / 4
            for m in group:
                assert abs(m.advantage - (m.reward - mean)) < 1e-5
                assert 0.0 <= m.metrics["similarity"] <= 1.0 and m.metrics["exact_match"] in (0.0, 1.0)

    records = read_metrics(run_dir / "metrics.jsonl", source="orchestrator")
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["num_samples"] == 8 and r["staleness_max"] == 0 and r["policy_version_min"] == r["step"]
        assert r["rollout_tokens_per_s"] > 0 and r["step_s"] >= r["rollout_s"] > 0
        assert 0 < r["completion_len_mean"] <= 12 and "env/exact_match" in r
    assert [r["wait_weights_s"] > 0.2 for r in steps] == [False, True, True]
    evals = [r for r in records if "eval/reward_mean" in r]
    assert [(r["step"], r["eval/policy_version"]) for r in evals] == [(0, 0), (2, 2), (3, 3)]
    assert all(
        r["eval/num_tasks"] == 4 and r["eval/failed"] == 0 and "eval/env/exact_match" in r for r in evals
    )

    # resume: only step 3 is new; earlier steps stay untouched
    before = {step: (step_dir(run_dir, step) / "rank_0.bin").stat().st_mtime_ns for step in range(3)}
    resumed = cfg.model_copy(update={"max_steps": 4, "resume": True})
    started = time.monotonic()
    assert run_with_trainer(resumed, tiny_model, first=3) == []
    assert before == {step: (step_dir(run_dir, step) / "rank_0.bin").stat().st_mtime_ns for step in range(3)}
    metas = [m for rank in range(2) for mb in read_rank(run_dir, 3, rank, timeout_s=5) for m in mb.samples]
    assert {m.policy_version for m in metas} == {3}
    assert sorted({m.task_id for m in metas}) == sorted(expected_task_ids(cfg, 3))
    steps = [
        r["step"]
        for r in read_metrics(run_dir / "metrics.jsonl", source="orchestrator")
        if "reward_mean" in r
    ]
    assert steps == [0, 1, 2, 3]
    print(
        f"first run (3 steps + 3 evals) {first_run_s:.1f}s, resumed step {time.monotonic() - started:.1f}s (CPU)"
    )
    assert json.loads((step_dir(run_dir, 3) / "READY").read_text()) == {"num_ranks": 2, "cp": 1}
