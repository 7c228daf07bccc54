"""max_async_level gating against a real server and a run directory whose STABLE markers appear
over time: PolicySync directly, then a whole orchestrator run at level 1 running ahead of a slow
stand-in trainer."""

import asyncio
import json
import time
from pathlib import Path

import pytest
from orchestrator_helpers import publish_weights, serve_base_model, served_version, wait_for_file

from tandem.client.config import ClientConfig, SamplingConfig
from tandem.client.inference import ServerPool
from tandem.orchestrator.config import OrchestratorConfig, WeightsConfig
from tandem.orchestrator.loop import Orchestrator
from tandem.orchestrator.weights import PolicySync, WeightsTimeout
from tandem.transport.rollouts import read_rank, step_dir
from tandem.transport.weights import latest_version


def test_wait_for_loads_weights_only_once_stable(server: str, tiny_model: Path, tmp_path: Path) -> None:
    serve_base_model(server, tiny_model, tmp_path / "base")

    async def scenario() -> dict:
        pool = ServerPool([server], ClientConfig(max_retries=1))
        await pool.connect()
        policy = PolicySync(tmp_path, pool, WeightsConfig(poll_interval=0.05, wait_timeout=30))
        out: dict = {}

        async def trainer() -> None:
            await asyncio.sleep(0.5)
            publish_weights(tiny_model, tmp_path, 1, stable=False)  # being written: not yet usable
            await asyncio.sleep(0.5)
            out["version_before_stable"] = served_version(server)
            out["stable_at"] = time.monotonic()
            publish_weights(tiny_model, tmp_path, 1)
            publish_weights(tiny_model, tmp_path, 2, stable=False)

        start = time.monotonic()
        publisher = asyncio.ensure_future(trainer())
        waited = await policy.wait_for(1, step=2, max_async_level=1)
        out["returned_at"], out["waited"] = time.monotonic(), waited
        await publisher
        out["version_after"] = served_version(server)
        out["policy_version"] = policy.version
        out["start"] = start

        # the watcher pushes a newer STABLE version to the server without being asked
        watcher = asyncio.ensure_future(policy.watch())
        publish_weights(tiny_model, tmp_path, 3)
        deadline = time.monotonic() + 20
        while served_version(server) != 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        out["watched_version"] = served_version(server)
        async with pool.lease() as client:
            result = await client.chat([{"role": "user", "content": "hi"}], SamplingConfig(max_tokens=4), n=2)
        out["choice_versions"] = [c.weight_versions for c in result.choices]
        watcher.cancel()

        with pytest.raises(WeightsTimeout, match=r"weights/step_5/STABLE: step 6 needs policy version >= 5"):
            await PolicySync(tmp_path, pool, WeightsConfig(poll_interval=0.05, wait_timeout=0.3)).wait_for(
                5, 6, 1
            )
        await pool.close()
        return out

    out = asyncio.run(scenario())
    assert out["version_before_stable"] == 0, "a weights directory without STABLE must not be loaded"
    assert out["returned_at"] >= out["stable_at"]
    assert out["waited"] >= 0.9
    assert out["version_after"] == 1 and out["policy_version"] == 1
    assert latest_version(tmp_path) == 3
    assert out["watched_version"] == 3
    assert out["choice_versions"] == [[3], [3]]


def test_level_one_runs_one_step_ahead_of_a_slow_trainer(
    server: str, tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": str(tiny_model)},
            "run_dir": run_dir,
            "max_steps": 3,
            "batch_size": 4,
            "group_size": 2,
            "seq_len": 128,
            "micro_batch_tokens": 128,
            "max_async_level": 1,
            "sampling": {"max_tokens": 8},
            "servers": [server],
            "env": {"args": {"num_train_tasks": 50, "num_eval_tasks": 4}},
            "weights": {"poll_interval": 0.05, "wait_timeout": 60},
        }
    )
    serve_base_model(server, tiny_model, tmp_path / "base")

    async def scenario() -> dict[str, float]:
        seen: dict[str, float] = {}

        async def watch_ready(step: int) -> None:
            seen[f"ready_{step}"] = await wait_for_file(step_dir(run_dir, step) / "READY")

        async def slow_trainer() -> None:
            for step in range(cfg.max_steps):
                await wait_for_file(step_dir(run_dir, step) / "READY")
                await asyncio.sleep(1.5)  # "training"
                seen[f"stable_{step + 1}"] = time.monotonic()
                publish_weights(tiny_model, run_dir, step + 1)

        watchers = [asyncio.ensure_future(watch_ready(step)) for step in range(cfg.max_steps)]
        trainer = asyncio.ensure_future(slow_trainer())
        await Orchestrator(cfg).run()
        await asyncio.gather(trainer, *watchers)
        return seen

    seen = asyncio.run(scenario())
    # step 1 may use policy 0, so it is written while the trainer still trains on step 0 ...
    assert seen["ready_1"] < seen["stable_1"]
    # ... but step 2 needs policy 1: never before weights/step_1/STABLE
    assert seen["ready_2"] >= seen["stable_1"]
    versions = {
        step: {s.policy_version for mb in read_rank(run_dir, step, 0, timeout_s=5) for s in mb.samples}
        for step in range(3)
    }
    assert versions[0] == {0} and versions[1] == {0}
    assert min(versions[2]) >= 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    staleness = {r["step"]: r["staleness_max"] for r in records if r["source"] == "orchestrator"}
    assert staleness[1] == 1 and staleness[2] <= 1
