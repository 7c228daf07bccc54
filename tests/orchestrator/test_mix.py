"""Several environments in one run: the per-step split by weight, its config, and a whole run
against a real inference server with two environments (per-environment samples, metrics and
evaluation)."""

import itertools
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from orchestrator_helpers import run_with_trainer, serve_base_model

from tandem.config.loader import ConfigError, parse_config
from tandem.envs.config import EnvConfig, chosen_environments
from tandem.envs.mixture import allocate, load_mixture
from tandem.launch.config import RLConfig
from tandem.launch.plan import plan_run
from tandem.monitor.metrics import read_metrics
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.tasks import step_task_order
from tandem.transport.rollouts import read_rank

SHORT = {"num_train_tasks": 30, "num_eval_tasks": 4, "max_len": 6}
LONG = {"num_train_tasks": 30, "num_eval_tasks": 4, "min_len": 10, "max_len": 12, "data_seed": 1}


def test_allocation_sums_to_the_batch_is_reproducible_and_matches_the_weights_over_steps() -> None:
    assert allocate([1.0], 7, seed=0, step=3) == [7]
    assert all(allocate([1, 1], 4, seed=0, step=s) == [2, 2] for s in range(50))  # exact shares stay exact
    weights = [1.0, 2.0, 1.5]
    splits = [allocate(weights, 3, seed=5, step=s) for s in range(3000)]
    assert all(sum(split) == 3 for split in splits)
    assert splits == [allocate(weights, 3, seed=5, step=s) for s in range(3000)]
    assert splits != [allocate(weights, 3, seed=6, step=s) for s in range(3000)]
    for i, w in enumerate(weights):
        share = sum(split[i] for split in splits) / (3 * 3000)
        assert share == pytest.approx(w / sum(weights), abs=0.01)
        # rounding never moves an environment more than one group away from its share
        assert {split[i] for split in splits} <= {int(3 * w / sum(weights)), int(3 * w / sum(weights)) + 1}
    with pytest.raises(ValueError, match="weights must be positive"):
        allocate([1.0, 0.0], 4, 0, 0)


def test_envs_tables_parse_and_mistakes_fail_with_one_line(tmp_path: Path) -> None:
    toml = tmp_path / "mix.toml"
    toml.write_text(
        '[[envs]]\nname = "reverse_text"\nlabel = "short"\nweight = 3\nargs = { max_len = 6 }\n\n'
        '[[envs]]\nname = "reverse_text"\nlabel = "long"\nargs = { min_len = 10 }\n'
    )
    cfg = parse_config(OrchestratorConfig, ["@", str(toml)])
    assert [(e.label, e.weight, e.args) for e in chosen_environments(cfg.env, cfg.envs)] == [
        ("short", 3.0, {"max_len": 6}),
        ("long", 1.0, {"min_len": 10}),
    ]
    assert [m.name for m in load_mixture(cfg.env, cfg.envs)] == ["short", "long"]
    default = parse_config(OrchestratorConfig, [])
    assert chosen_environments(default.env, default.envs) == [EnvConfig()]  # the single [env] form
    with pytest.raises(ConfigError, match=r"give either \[env\] or \[\[envs\]\], not both"):
        parse_config(OrchestratorConfig, ["@", str(toml), "--env.name", "math"])
    with pytest.raises(ConfigError, match="envs.0.weight"):
        parse_config(OrchestratorConfig, ["@", str(toml), "--envs", '[{name = "reverse_text", weight = 0}]'])
    with pytest.raises(ConfigError, match="two environments are named 'reverse_text'; give one a `label`"):
        load_mixture(EnvConfig(), [EnvConfig(), EnvConfig(args={"max_len": 5})])
    # the rl launcher writes the orchestrator's config file; the mix survives the round trip
    rl = tmp_path / "rl.toml"
    rl.write_text('[model]\nname = "m"\n\n' + toml.read_text().replace("[[envs]]", "[[orchestrator.envs]]"))
    written = plan_run(parse_config(RLConfig, ["@", str(rl)]), visible_gpus=[]).files()["orchestrator"]
    reread = OrchestratorConfig.model_validate(tomllib.loads(written))
    assert chosen_environments(reread.env, reread.envs) == chosen_environments(cfg.env, cfg.envs)


def test_a_mixed_run_tags_samples_and_logs_metrics_per_environment(
    server: str, tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": str(tiny_model)},
            "run_dir": run_dir,
            "max_steps": 2,
            "batch_size": 12,
            "group_size": 2,
            "seq_len": 96,
            "micro_batch_tokens": 192,
            "max_async_level": 0,
            "sampling": {"max_tokens": 10},
            "servers": [server],
            "envs": [
                {"name": "reverse_text", "label": "short", "weight": 2, "args": SHORT},
                {"name": "reverse_text", "label": "long", "weight": 1, "args": LONG},
            ],
            "eval": {"interval": 2, "num_tasks": 3},
            "weights": {"poll_interval": 0.05, "wait_timeout": 60},
        }
    )
    serve_base_model(server, tiny_model, tmp_path / "base")
    assert run_with_trainer(cfg, tiny_model, first=0) == []

    members = load_mixture(cfg.env, cfg.envs)
    records = read_metrics(run_dir / "metrics.jsonl", source="orchestrator")
    steps = [r for r in records if "reward_mean" in r]
    for step, record in zip(range(2), steps, strict=True):
        samples = [
            s for rank in range(1) for mb in read_rank(run_dir, step, rank, timeout_s=5) for s in mb.samples
        ]
        counts = allocate([2, 1], 6, cfg.seed, step)
        assert Counter(s.env for s in samples) == {"short": 2 * counts[0], "long": 2 * counts[1]}
        for e, member in enumerate(members):
            # each environment draws from its own stream of its own tasks
            tasks = member.env.dataset("train")
            order = step_task_order(len(tasks), cfg.seed, step, member.name)
            expected = {tasks[i].task_id for i in itertools.islice(order, counts[e])}
            mine = [s for s in samples if s.env == member.name]
            assert {s.task_id for s in mine} == expected
            assert record[f"env/{member.name}/num_samples"] == len(mine)
            assert record[f"env/{member.name}/reward_mean"] == pytest.approx(
                sum(s.reward for s in mine) / len(mine), abs=1e-5
            )
            assert f"env/{member.name}/exact_match" in record and f"env/{member.name}/similarity" in record
        assert record["num_samples"] == 12 and record["groups_failed"] == 0
        long_prompts = [s.prompt_len for s in samples if s.env == "long"]
        short_prompts = [s.prompt_len for s in samples if s.env == "short"]
        assert min(long_prompts) > max(short_prompts)  # the two environments' own args were used
    evals = [r for r in records if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/num_tasks"] == 6 and r["eval/failed"] == 0
        assert r["eval/env/short/num_tasks"] == r["eval/env/long/num_tasks"] == 3
        mean = (r["eval/env/short/reward_mean"] + r["eval/env/long/reward_mean"]) / 2
        assert r["eval/reward_mean"] == pytest.approx(mean, abs=1e-6)
