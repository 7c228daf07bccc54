"""Seeds of sampling requests: a function of the request's place in the run only, different for
every group, sample and turn, and absent unless the run asks for them."""

from pathlib import Path

import pytest

from tandem.client.config import SamplingConfig
from tandem.client.seeds import SEED_BITS, group_seed
from tandem.config.loader import ConfigError, build_config
from tandem.envs.mixture import Member
from tandem.envs.reverse_text_env import ReverseTextEnv
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.rollouts import RolloutCollector


def collector(tmp_path: Path, **fields: object) -> RolloutCollector:
    cfg = OrchestratorConfig.model_validate({"run_dir": tmp_path, **fields})
    env = ReverseTextEnv(ReverseTextEnv.Args(num_train_tasks=8, num_eval_tasks=2))
    return RolloutCollector([Member("reverse_text", env)], pool=None, cfg=cfg)  # type: ignore[arg-type]


def test_group_seeds_differ_by_every_part_and_repeat_exactly() -> None:
    base = (0, 3, "reverse_text", 5, "train-0-7")
    variants = [base, (1, *base[1:]), (0, 4, *base[2:]), (0, 3, "wordle", 5, "train-0-7")]
    variants += [(0, 3, "reverse_text", 6, "train-0-7"), (0, 3, "reverse_text", 5, "train-0-8")]
    seeds = [group_seed(*v) for v in variants]
    assert len(set(seeds)) == len(seeds)
    assert group_seed(*base) == seeds[0]
    assert all(0 <= s < 2**SEED_BITS for s in seeds)


def test_parts_of_a_seeded_request_get_their_own_seeds() -> None:
    sampling = SamplingConfig(request_seed=group_seed(0, 0, "env", 0, "t"))
    samples = [sampling.for_part(i) for i in range(4)]
    turns = [samples[0].for_part(k) for k in range(1, 4)]
    seeds = {s.request_seed for s in [sampling, *samples, *turns]}
    assert len(seeds) == 8
    assert sampling.for_part(2) == samples[2]  # repeatable
    assert SamplingConfig().for_part(3).request_seed is None  # unseeded stays unseeded


def test_the_collector_seeds_groups_only_when_asked(tmp_path: Path) -> None:
    seeded = collector(tmp_path, seeded_sampling=True, seed=7)
    member, task = seeded.members[0], seeded.tasks[0][2]
    sampling = seeded.sampling(4, (0, 9), member, task)
    assert sampling.request_seed == group_seed(7, 4, "reverse_text", 9, task.task_id)
    assert sampling.temperature == seeded.cfg.sampling.temperature
    assert collector(tmp_path).sampling(4, (0, 9), member, task).request_seed is None


def test_a_request_seed_in_the_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="sampling.request_seed is set per request by the orchestrator"):
        build_config(OrchestratorConfig, overrides=[("sampling.request_seed", 3)])
