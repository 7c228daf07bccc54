"""Several environments in one run, each step's groups split between them by weight.

The split of step N depends on (seed, N) only, so a resumed run draws the same mix as an
uninterrupted one. Every environment gets the whole part of its share; the groups left over go
to environments drawn with probability equal to the fractional part of their share (systematic
sampling). Over many steps each environment's share of groups therefore matches its weight in
expectation, and rounding never favours one environment.
"""

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.config.loader import ConfigError
from tandem.envs.base import Environment, Split
from tandem.envs.config import EnvConfig, chosen_environments, environment_keys
from tandem.envs.registry import load_environment

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One environment of the mixture, under the name its samples and metrics carry."""

    name: str
    env: Environment
    weight: float = 1.0


def load_mixture(env: EnvConfig, envs: list[EnvConfig], section: str = "") -> list[Member]:
    """Build the run's environments ([[envs]] when given, else [env]); names (label, else the
    environment's own name) must be distinct. Errors name the table's key under `section`
    ("orchestrator." in rl.toml): `envs.1.args.max_len`, `orchestrator.env.name`."""
    configs = chosen_environments(env, envs)
    keys = environment_keys(env, envs, section)
    members: list[Member] = []
    for config, key in zip(configs, keys, strict=True):
        built = load_environment(config.name, config.args, key)
        name = config.label or built.name or config.name
        if any(m.name == name for m in members):
            raise ConfigError(f"{section}envs: two environments are named '{name}'; give one a `label`")
        built.name = name
        members.append(Member(name, built, config.weight))
    if not members:
        raise ConfigError(f"{section}envs: no environment given")
    return members


SPLIT_NAMES = {"train": "training split", "eval": "held-out split"}


def split_tasks(member: Member, split: Split = "train") -> Sequence[Any]:
    """The member's tasks of `split`, read at start: a split that cannot be read (a data file
    missing, a malformed row) or is empty is a ConfigError naming the environment, in one line."""
    what = SPLIT_NAMES[split]
    try:
        tasks = member.env.dataset(split)
        count = len(tasks)
    except ConfigError:
        raise
    except Exception as e:
        log.debug("traceback of env %s's %s", member.name, what, exc_info=e)
        raise ConfigError(f"env {member.name}: cannot load its {what}: {type(e).__name__}: {e}") from None
    if count == 0:
        raise ConfigError(f"env {member.name}: its {what} is empty")
    return tasks


def allocate(weights: Sequence[float], total: int, seed: int, step: int) -> list[int]:
    """How many of `total` groups each environment gets at `step` (sums to `total`)."""
    if not weights or min(weights) <= 0:
        raise ValueError(f"weights must be positive, got {list(weights)}")
    shares = [total * w / sum(weights) for w in weights]
    counts = [math.floor(s) for s in shares]
    fractions = [s - c for s, c in zip(shares, counts, strict=True)]
    left = total - sum(counts)
    point = random.Random(f"tandem/env-mix/{seed}/{step}").random()
    cumulative = 0.0
    for i, fraction in enumerate(fractions):
        cumulative += fraction
        if left and point < cumulative:
            counts[i] += 1
            fractions[i] = 0.0
            point += 1.0
            left -= 1
    # floating-point rounding can leave the last point just past the cumulative sum
    for i in sorted(range(len(fractions)), key=lambda i: -fractions[i])[:left]:
        counts[i] += 1
    return counts
