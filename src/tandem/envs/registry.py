"""Environments by name: `load_environment("reverse_text", {...})` or an import path `pkg.mod:Class`."""

import difflib
import importlib
from typing import Any

from pydantic import ValidationError

from tandem.config.loader import ConfigError
from tandem.envs.base import Environment

BUILT_IN = {
    "reverse_text": "tandem.envs.reverse_text_env:ReverseTextEnv",
    "wordle": "tandem.envs.wordle:WordleEnv",
    "alphabet_sort": "tandem.envs.alphabet_sort:AlphabetSortEnv",
    "math": "tandem.envs.math_env:MathEnv",
    "code": "tandem.envs.code_env:CodeEnv",
    "calculator": "tandem.envs.calculator_env:CalculatorEnv",
}


def resolve(name: str, key: str = "env") -> type[Environment]:
    """The Environment class of `name`; errors name `{key}.name`."""
    target = BUILT_IN.get(name, name)
    module_name, colon, class_name = target.partition(":")
    if not colon:
        close = difflib.get_close_matches(name, BUILT_IN, n=1, cutoff=0.6)
        guess = f"did you mean '{close[0]}'? " if close else ""
        known = ", ".join(sorted(BUILT_IN))
        raise ConfigError(
            f"{key}.name: unknown environment '{name}' ({guess}built in: {known}; or 'module:Class', or "
            "'verifiers:<env id>')"
        )
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}.name: cannot import '{target}': {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"{key}.name: '{target}' is not a tandem Environment subclass")
    return cls


def load_environment(name: str, args: dict[str, Any] | None = None, key: str = "env") -> Environment:
    """Build the environment with validated args; mistakes raise ConfigError naming `{key}.args.X`
    (`key` is where the environment's table is: `env`, `envs.1`, `orchestrator.env` in rl.toml).
    An environment's own ValueError names its args as `env.args...`; that prefix becomes `key`'s.

    `verifiers:<env id>` loads an environment written for verifiers (its args go to the
    environment's own load_environment) through tandem.envs.verifiers_adapter."""
    if name.startswith("verifiers:"):
        from tandem.envs.verifiers_adapter import VerifiersEnv

        return VerifiersEnv.load(name.removeprefix("verifiers:"), args)
    cls = resolve(name, key)
    try:
        parsed = cls.Args.model_validate(args or {}, strict=True)  # (typed by TOML, as the config)
        return cls(parsed)
    except ValidationError as e:
        problems = [f"'{key}.args.{'.'.join(map(str, err['loc']))}': {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid environment args: " + "; ".join(problems)) from None
    except ValueError as e:
        message = str(e)
        if message.startswith("env.args"):
            message = key + message.removeprefix("env")
        raise ConfigError(message) from None
