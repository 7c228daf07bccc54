"""Which environments a run uses (`[env]`, or several `[[envs]]` with weights)."""

from typing import Any

from pydantic import Field
from pydantic_core import PydanticCustomError

from tandem.config.base import Section


class EnvConfig(Section):
    """Which environment produces tasks, rollouts and rewards."""

    name: str = Field(
        "reverse_text",
        description="A registered name (see tandem.envs.registry), an import path 'module:Class', or "
        "'verifiers:<env id>' for an environment written for verifiers.",
    )
    args: dict[str, Any] = Field({}, description="Keyword arguments of the environment (its Args section).")
    weight: float = Field(
        1.0,
        gt=0,
        description="With several [[envs]]: its share of each step's groups (weights are normalised).",
    )
    label: str | None = Field(
        None,
        description="Name in metrics and samples; default: the environment's own name "
        "(needed when one environment is mixed in twice).",
    )


def chosen_environments(env: EnvConfig, envs: list[EnvConfig]) -> list[EnvConfig]:
    """[[envs]] when given, else the single [env]; both given is an error (raised in validators)."""
    if envs and env != EnvConfig():
        raise PydanticCustomError("shape", "give either [env] or [[envs]], not both")
    return list(envs) or [env]


def environment_keys(env: EnvConfig, envs: list[EnvConfig], section: str = "") -> list[str]:
    """Where each of chosen_environments' tables is in the config (`envs.0`, … or `env`), under
    `section` ("orchestrator." in rl.toml), for errors that name a key."""
    return [f"{section}envs.{i}" for i in range(len(envs))] if envs else [f"{section}env"]
