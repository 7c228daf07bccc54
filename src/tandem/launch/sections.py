"""From the one RLConfig to each process's section: shared values fill what a section left
unset, the fields the launcher owns (ports, server URLs, rank counts, run_dir, the weight group's
address) are set by it, and a section that sets one of those differently is an error naming where
the launcher takes it from. Fields that must agree between the processes are checked here, so a
mismatch is one clear line at start rather than a hang later."""

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tandem.config.loader import ConfigError, deep_merge, format_validation_error
from tandem.inference.config import InferenceConfig
from tandem.launch.config import RLConfig
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.rl.config import RLTrainerConfig

M = TypeVar("M", bound=BaseModel)

DERIVED_FROM = {
    "run_dir": "the top-level run_dir",
    "resume": "the top-level resume (--resume)",
    "servers": "inference.port / deployment.inference_ports",
    "prefill_servers": "deployment.prefill_servers",
    "num_ranks": "deployment.trainer_nproc",
    "cp": "trainer.parallel.cp",
    "cp_style": "trainer.parallel.cp_style",
    "weights.transport": "the top-level weights.transport",
    "weights.host": "the top-level weights.host (several nodes: the trainer node that runs rank 0)",
    "weights.port": "the top-level weights.port (a free port when 0; several nodes: cluster.weights_group_port)",
}
"""Where the launcher takes each field it owns from (named in errors)."""


def with_weights(name: str, section: M, config: RLConfig, owned: dict[str, Any]) -> M:
    """The section's weights: the top-level [weights] with the section's own keys over it, and the
    fields the launcher owns. A section that sets the transport or the address differently is an
    error; num_servers and server_index are always the launcher's."""
    own = section.weights.model_dump(exclude_unset=True)  # type: ignore[attr-defined]
    for key, value in owned.items():
        if f"weights.{key}" in DERIVED_FROM and key in own and own[key] != value:
            raise ConfigError(
                f"{name}.weights.{key} = {own[key]!r} conflicts with {value!r}, which the launcher derives "
                f"from {DERIVED_FROM['weights.' + key]}; set that instead"
            )
    merged = deep_merge(config.weights.model_dump(), own) | owned
    return updated(name, section, {"weights": merged})


def inference_section(config: RLConfig, colocated: bool) -> InferenceConfig:
    inference = _fill(config.inference, "inference", _shared(config), {"run_dir": config.run_dir})
    return updated("inference", inference, _inference_defaults(config, colocated))


def process_sections(
    config: RLConfig,
    per_server: list[InferenceConfig],
    servers: list[str],
    num_ranks: int,
    link: dict[str, Any],
    prefill: list[str] | None = None,
) -> tuple[RLConfig, OrchestratorConfig, RLTrainerConfig]:
    """The orchestrator's and trainer's sections, checked against the servers', and the resolved
    whole (what run_dir/configs/rl.toml holds). `servers` take rollouts; `prefill` servers only
    weights."""
    prefill = prefill or []
    inference = per_server[0]
    shared, owned = _shared(config), {"run_dir": config.run_dir, "resume": config.resume}
    parallel = config.trainer.parallel
    trainer_shape = {"num_ranks": num_ranks, "cp": parallel.cp, "cp_style": parallel.cp_style}
    orchestrator = _fill(
        config.orchestrator,
        "orchestrator",
        shared,
        owned | {"servers": servers, "prefill_servers": prefill} | trainer_shape,
    )
    if inference.api_key and orchestrator.client.api_key is None:
        orchestrator = updated("orchestrator", orchestrator, {"client": {"api_key": inference.api_key}})
    orchestrator = with_weights("orchestrator", orchestrator, config, link)
    trainer = _fill(config.trainer, "trainer", shared, owned)
    trainer = with_weights("trainer", trainer, config, link | {"num_servers": len(servers) + len(prefill)})
    _check_agreement(inference, orchestrator, trainer)
    resolved = updated("", config, {"inference": inference, "orchestrator": orchestrator, "trainer": trainer})
    return resolved, orchestrator, trainer


def effective_defaults(config: RLConfig) -> RLConfig:
    """`config` with each process's section as rl fills it in where the section leaves a key unset
    (the shared top-level keys, the top-level [weights], run_dir, the servers' context length):
    what `rl --help` and docs/config-reference.md give as the per-process keys' defaults. What
    depends on the machine (ports, server URLs, ranks, a GPU shared with the trainer) is left as
    the section has it."""
    shared, owned = _shared(config), {"run_dir": config.run_dir, "resume": config.resume}
    sections = {
        "inference": inference_section(config, colocated=False),
        "orchestrator": _fill(config.orchestrator, "orchestrator", shared, owned),
        "trainer": _fill(config.trainer, "trainer", shared, owned),
    }
    return updated("", config, {k: with_weights(k, v, config, {}) for k, v in sections.items()})


def _shared(config: RLConfig) -> dict[str, Any]:
    return {
        "model": config.model,
        "seq_len": config.seq_len,
        "max_steps": config.max_steps,
        "seed": config.seed,
        "monitor": config.monitor,
    }


def _fill(section: M, name: str, shared: dict[str, Any], owned: dict[str, Any]) -> M:
    """Shared values where the section left them unset; launcher-owned values always.

    A launcher-owned field the user set to something else is an error, not silently replaced.
    """
    updates = {
        k: v
        for k, v in shared.items()
        if k in type(section).model_fields and k not in section.model_fields_set
    }
    for key, value in owned.items():
        given = _plain(getattr(section, key))
        if key in section.model_fields_set and given != _plain(value):
            raise ConfigError(
                f"{name}.{key} = {given!r} conflicts with {_plain(value)!r}, which the launcher derives "
                f"from {DERIVED_FROM[key]}; set that instead"
            )
        updates[key] = value
    return updated(name, section, updates)


def _inference_defaults(config: RLConfig, colocated: bool) -> dict[str, Any]:
    """The server's context length is seq_len; a server sharing a GPU gets a smaller memory share;
    with trainer.lora, vLLM serves adapters of its rank; seeded sampling turns the native engine's
    prefix cache off (a cached prefix changes the last bits of the logits, so a repeated run would
    drift: docs/async.md)."""
    inf = config.inference
    engine: dict[str, Any] = {}
    vllm: dict[str, Any] = {}
    if inf.engine.max_model_len is None:
        engine["max_model_len"] = config.seq_len
    if config.orchestrator.seeded_sampling and "prefix_caching" not in inf.engine.model_fields_set:
        engine["prefix_caching"] = False
    if inf.vllm.max_model_len is None:
        vllm["max_model_len"] = config.seq_len
    lora = config.trainer.lora
    if lora is not None and lora.enabled and inf.vllm.max_lora_rank is None:
        vllm["max_lora_rank"] = lora.rank
    if colocated:
        share = config.deployment.colocated_gpu_memory_utilization
        if "gpu_memory_utilization" not in inf.engine.model_fields_set:
            engine["gpu_memory_utilization"] = share
        if "gpu_memory_utilization" not in inf.vllm.model_fields_set:
            vllm["gpu_memory_utilization"] = share
    return {"engine": engine, "vllm": vllm}


def _check_agreement(
    inference: InferenceConfig, orchestrator: OrchestratorConfig, trainer: RLTrainerConfig
) -> None:
    if not orchestrator.model.name:
        raise ConfigError("model.name is empty: set the policy's checkpoint under [model]")
    names = {
        "inference": inference.model.name,
        "orchestrator": orchestrator.model.name,
        "trainer": trainer.model.name,
    }
    if len(set(names.values())) > 1:
        shown = ", ".join(f"{k}.model.name={v!r}" for k, v in names.items())
        raise ConfigError(f"every process must start from the same checkpoint, got {shown}")
    if orchestrator.max_steps != trainer.max_steps:
        raise ConfigError(
            f"orchestrator.max_steps ({orchestrator.max_steps}) and trainer.max_steps ({trainer.max_steps}) "
            "differ; set max_steps once at the top level"
        )
    ep, ranks = trainer.parallel.ep, orchestrator.num_ranks
    if ranks % ep:
        raise ConfigError(
            f"trainer.parallel.ep = {ep} does not divide the trainer's {ranks} ranks (deployment.trainer_nproc)"
        )
    lora = trainer.lora
    if (
        lora is not None
        and lora.enabled
        and inference.engine.quantization == "fp8"
        and inference.backend != "vllm"
    ):
        raise ConfigError(
            "trainer.lora with inference.engine.quantization = 'fp8': the native engine merges adapters "
            "into its bf16 weights; set quantization = 'none' (or inference.backend = 'vllm')"
        )
    group, max_n = orchestrator.group_size, inference.engine.max_n
    if inference.backend != "vllm" and group > max_n:
        raise ConfigError(
            f"orchestrator.group_size ({group}) exceeds inference.engine.max_n ({max_n}), the most samples "
            "the native engine gives one request (a group's): raise inference.engine.max_n"
        )
    keep, lag = trainer.weights.keep, orchestrator.max_async_level
    if not trainer.weights.in_memory and keep and keep <= lag:
        raise ConfigError(
            f"trainer.weights.keep ({keep}) must exceed orchestrator.max_async_level ({lag}), or be 0 (keep all)"
        )


def updated(name: str, model: M, updates: dict[str, Any]) -> M:
    """A validated copy of `model` with `updates` merged in (nested dicts merge into sub-sections)."""
    data = model.model_dump(exclude_unset=True)
    data = deep_merge(data, updates)
    try:
        return type(model).model_validate(data)
    except ValidationError as e:
        raise ConfigError(
            f"{format_validation_error(e, type(model))} (in the resolved {name or 'rl'} config)"
        ) from None


def _plain(value: Any) -> Any:
    """A value as the user wrote it, for comparisons and messages."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value) if isinstance(value, Path) else value
