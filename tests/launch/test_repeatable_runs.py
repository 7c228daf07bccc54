"""The reproducible mode on CPU: two runs of the reverse-text RL example (examples/reverse_text/rl.toml
with its shipped SFT checkpoint, resolved by the launcher's plan; two small steps) with
max_async_level = 0 and seeded sampling log the same rewards and losses to metrics.jsonl and
publish bit-identical final weights (without seeds the second run draws other tokens: the
server's own generator has moved on). The first run also logs to W&B in offline mode (the real
wandb package), which changes nothing; what it wrote is read back with wandb's own reader
(`wandb leet inspect --json`): the orchestrator's and the trainer's metrics in one run, the
resolved config, and a table of rollouts.

The orchestrator and the trainer run inside the test process (the orchestrator on an event loop,
the trainer in a thread: the same `Orchestrator.run` and `train` that `rl` starts as processes),
against one real inference server that is put back on the base weights before each run: one
`rl` launch of the example (3 small steps) took 105–250 s on the shared 2-core machine, mostly start-up.
"""

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file
from server_process import RunningServer, start_server
from wandb_offline import history, keep_wandb_home_in, offline_runs, records

from tandem.config.loader import parse_config, to_toml
from tandem.launch.config import RLConfig
from tandem.launch.plan import RunPlan, plan_run
from tandem.monitor.metrics import read_metrics
from tandem.monitor.wandb_run import RUN_CONFIG_ENV
from tandem.orchestrator.loop import Orchestrator
from tandem.trainer.rl.train import train

pytest.importorskip("wandb", reason="the wandb extra (uv sync --extra wandb)")
EXAMPLE = Path(__file__).parents[2] / "examples" / "reverse_text"
STEPS = 2
ROWS_DIFFER = "round a row differently by batch size"  # the engine's warning (model_runner.py)


def example_plan(run_dir: Path, port: int, *overrides: str) -> RunPlan:
    """The example's config, made small, resolved for this machine as `rl` resolves it."""
    argv = ["@", str(EXAMPLE / "rl.toml"), "--model.name", str(EXAMPLE / "sft-checkpoint")]
    argv += ["--run_dir", str(run_dir), "--max_steps", str(STEPS), "--inference.port", str(port)]
    argv += ["--weights.transport", "filesystem", "--trainer.ckpt.interval", "0"]
    argv += ["--weights.wait_timeout", "120", "--trainer.rollout_timeout_s", "120"]  # a failed side
    argv += ["--orchestrator.batch_size", "16", "--orchestrator.group_size", "4"]
    argv += ["--orchestrator.max_async_level", "0", "--orchestrator.eval.interval", "0"]
    argv += ["--orchestrator.env.args.num_train_tasks", "256", "--orchestrator.env.args.num_eval_tasks", "8"]
    return plan_run(parse_config(RLConfig, [*argv, *overrides]), visible_gpus=[])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server with the example's inference section (prefix cache off, as seeded runs have it)."""
    scratch = tmp_path_factory.mktemp("server")
    plan = example_plan(scratch / "unused", 0, "--orchestrator.seeded_sampling", "true")
    assert plan.inference[0].engine.prefix_caching is False
    (scratch / "inference.toml").write_text(to_toml(plan.inference[0]))
    with start_server(["@", str(scratch / "inference.toml")], scratch / "server.log", 240, threads="1") as s:
        yield s


def serve_base_weights(server: RunningServer, scratch: Path) -> None:
    """Version 0 again, as a fresh server would serve it (the same checkpoint, loaded as step_0)."""
    step_0 = scratch / "weights" / "step_0"
    step_0.parent.mkdir(parents=True)
    step_0.symlink_to(EXAMPLE / "sft-checkpoint")
    answer = httpx.post(f"{server.url}/update_weights", json={"path": str(step_0)}, timeout=60)
    assert answer.json()["weight_version"] == 0, answer.text


def run_example(server: RunningServer, tmp_path: Path, name: str, *overrides: str) -> Path:
    """One whole run: the plan's orchestrator and trainer against `server`; returns its run_dir."""
    serve_base_weights(server, tmp_path / f"{name}-base")
    port = int(server.url.rsplit(":", 1)[1])
    plan = example_plan(tmp_path / name, port, *overrides)
    plan.write_configs()
    failures: list[BaseException] = []

    def trainer() -> None:
        try:
            train(plan.trainer)
        except BaseException as e:  # reported by the test below
            failures.append(e)

    thread = threading.Thread(target=trainer, name=f"trainer-{name}", daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(RUN_CONFIG_ENV, str(plan.config_dir / "rl.toml"))  # as the launcher sets it
        asyncio.run(Orchestrator(plan.orchestrator).run())
    thread.join(timeout=120)
    assert not thread.is_alive() and not failures, failures
    return plan.config.run_dir


def numbers(run_dir: Path) -> dict[str, list[tuple[Any, ...]]]:
    metrics = run_dir / "metrics.jsonl"
    return {
        "orchestrator": [(r["step"], r["reward_mean"]) for r in read_metrics(metrics, "orchestrator")],
        "trainer": [(r["step"], r["reward"], r["loss"]) for r in read_metrics(metrics, "trainer")],
    }


def final_weights(run_dir: Path) -> dict[str, Any]:
    return load_file(run_dir / "weights" / f"step_{STEPS}" / "model.safetensors")


def test_seeded_runs_repeat_exactly_and_wandb_holds_the_whole_run(
    server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ROWS_DIFFER in server.log_path.read_text():
        pytest.skip("the server warned that this CPU's matrix products round a row by batch size")
    keep_wandb_home_in(tmp_path / "wandb-home", monkeypatch)
    seeded = ["--orchestrator.seeded_sampling", "true"]
    wandb = [
        "--monitor.wandb.mode",
        "offline",
        "--monitor.wandb.project",
        "repro",
        "--monitor.wandb.tags",
        '["ci"]',
    ]
    first = run_example(server, tmp_path, "first", *seeded, *wandb, "--monitor.wandb.sample_interval", "1")
    second = run_example(server, tmp_path, "second", *seeded)

    expected = numbers(first)
    assert [[r[0] for r in expected[source]] for source in ("orchestrator", "trainer")] == [[0, 1], [0, 1]]
    assert numbers(second) == expected
    weights = final_weights(first)
    assert all((weights[k] == v).all() for k, v in final_weights(second).items())

    (offline,) = offline_runs(first)
    logged = records(offline)
    (run,) = [r["run"] for r in logged if r["type"] == "run"]
    assert run["project"] == "repro" and run["display_name"] == "first" and run["tags"] == ["ci"]
    config = run["config"]["update"]
    assert config["orchestrator"]["seeded_sampling"] is True and config["trainer"]["optim"]["lr"] == 3e-4
    rows_logged = history(logged)
    trainer = [
        (h["trainer/step"], h["trainer/reward"], h["trainer/loss"])
        for h in rows_logged
        if "trainer/loss" in h
    ]
    orchestrator = [
        (h["orchestrator/step"], h["orchestrator/reward_mean"])
        for h in rows_logged
        if "orchestrator/reward_mean" in h
    ]
    assert trainer == expected["trainer"] and orchestrator == expected["orchestrator"]
    tables = [h for h in rows_logged if h.get("orchestrator/rollouts._type") == "table-file"]
    assert [t["orchestrator/step"] for t in tables] == [0, 1]
    table = json.loads((offline / "files" / tables[0]["orchestrator/rollouts.path"]).read_text())
    assert table["columns"][:4] == ["step", "env", "task_id", "prompt"]
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len(rows) == 16 and all("Reverse" in r["prompt"] for r in rows)
    assert sum(r["reward"] for r in rows) / 16 == pytest.approx(expected["orchestrator"][0][1])
    assert sum(r["advantage"] for r in rows) == pytest.approx(0, abs=1e-6)  # group-relative
    assert (
        json.loads((first / "wandb" / "forwarded.json").read_text())["offset"]
        == (first / "metrics.jsonl").stat().st_size
    )
