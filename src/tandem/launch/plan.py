"""From one RLConfig to the per-process configs and commands of a run.

The launcher owns the fields that connect the processes: each server's port, the orchestrator's
server URLs and rank count, run_dir and resume. Top-level shared fields fill every section that
left them unset; fields that must agree between processes are checked here, so a mismatch is one
clear line at start rather than a hang later.
"""

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tandem.config.loader import ConfigError, deep_merge, format_validation_error, to_toml
from tandem.inference.config import InferenceConfig
from tandem.launch.config import RLConfig
from tandem.launch.devices import DeviceAssignment, assign_devices
from tandem.launch.supervisor import ProcessSpec
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.transport.config import WeightsConfig

M = TypeVar("M", bound=BaseModel)

INFERENCE_MODULE = "tandem.inference.cli"
ORCHESTRATOR_MODULE = "tandem.orchestrator.cli"
TRAINER_MODULE = "tandem.trainer.rl.cli"

DERIVED_FROM = {
    "run_dir": "the top-level run_dir",
    "resume": "the top-level resume (--resume)",
    "servers": "inference.port / deployment.inference_ports",
    "num_ranks": "deployment.trainer_nproc",
    "weights.transport": "the top-level weights.transport",
    "weights.host": "the top-level weights.host",
    "weights.port": "the top-level weights.port (a free port when 0)",
}
"""Where the launcher takes each field it owns from (named in errors)."""


@dataclass
class RunPlan:
    config: RLConfig  # as resolved: what run_dir/configs/rl.toml holds
    devices: DeviceAssignment
    inference: list[InferenceConfig]
    orchestrator: OrchestratorConfig
    trainer: RLTrainerConfig
    cpu_threads: int | None = None  # OMP_NUM_THREADS of each server and trainer rank (CPU runs)

    @property
    def config_dir(self) -> Path:
        return self.config.run_dir / "configs"

    @property
    def log_dir(self) -> Path:
        return self.config.run_dir / "logs"

    def files(self) -> dict[str, str]:
        """run_dir/configs/<name>.toml → its text."""
        texts = {f"inference_{i}": to_toml(c) for i, c in enumerate(self.inference)}
        texts |= {"orchestrator": to_toml(self.orchestrator), "trainer": to_toml(self.trainer)}
        texts["rl"] = to_toml(self.config)
        return texts

    def write_configs(self) -> None:
        self.config_dir.mkdir(parents=True, exist_ok=True)
        for name, text in self.files().items():
            path = self.config_dir / f"{name}.toml"
            tmp = path.with_suffix(".toml.tmp")
            tmp.write_text(text)
            tmp.replace(path)

    def specs(self) -> list[ProcessSpec]:
        """The processes to start, servers first, each pinned to its devices."""
        python = sys.executable
        specs = []
        for i, (cfg, gpus) in enumerate(zip(self.inference, self.devices.inference, strict=True)):
            specs.append(
                ProcessSpec(
                    f"inference_{i}" if len(self.inference) > 1 else "inference",
                    [python, "-m", INFERENCE_MODULE, "@", str(self.config_dir / f"inference_{i}.toml")],
                    env={"CUDA_VISIBLE_DEVICES": ",".join(gpus)} | self._threads(),
                    role="service",
                    health_url=f"{server_url(cfg)}/health",
                )
            )
        nproc = self.devices.trainer_nproc
        runner = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        trainer_argv = [*(runner if nproc > 1 else [python]), "-m", TRAINER_MODULE]
        specs.append(
            ProcessSpec(
                "trainer",
                [*trainer_argv, "@", str(self.config_dir / "trainer.toml")],
                env={"CUDA_VISIBLE_DEVICES": ",".join(self.devices.trainer)} | self._threads(),
            )
        )
        specs.append(
            ProcessSpec(
                "orchestrator",
                [python, "-m", ORCHESTRATOR_MODULE, "@", str(self.config_dir / "orchestrator.toml")],
                env={"CUDA_VISIBLE_DEVICES": ""},
            )
        )
        return specs

    def _threads(self) -> dict[str, str]:
        return {} if self.cpu_threads is None else {"OMP_NUM_THREADS": str(self.cpu_threads)}


def cpu_threads(config: RLConfig, devices: DeviceAssignment, cores: int) -> int | None:
    """On CPU runs, split the cores between the servers and the trainer ranks, as torchrun does
    between its ranks: several processes each using every core oversubscribe the CPU."""
    if devices.on_gpu:
        return None
    if config.deployment.cpu_threads is not None:
        return config.deployment.cpu_threads
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, cores // (len(devices.inference) + devices.trainer_nproc))


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: respects taskset and cpusets
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def server_url(cfg: InferenceConfig) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    return f"http://{host}:{cfg.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def weight_group_address(config: RLConfig) -> tuple[str, int]:
    """Where trainer rank 0 hosts the weight group's store. One machine: 127.0.0.1 (or the given
    host) and the given port, else a free one. (A multi-node deployment derives this instead.)"""
    return config.weights.host, config.weights.port or free_port(config.weights.host)


def check_transport(weights: WeightsConfig, devices: DeviceAssignment) -> None:
    """Refuse, before anything starts, a transport the device split cannot carry."""
    if not weights.in_memory:
        return
    for i, gpus in enumerate(devices.inference):
        if len(gpus) > 1:
            raise ConfigError(
                f"weights.transport = {weights.transport}: inference server {i} has {len(gpus)} GPUs; the "
                "in-memory transports feed one GPU per server (use filesystem for tensor-parallel servers)"
            )
    if not devices.on_gpu:
        return
    rank0 = devices.trainer[0]
    for i, gpus in enumerate(devices.inference):
        shared = set(gpus) & set(devices.trainer)
        if weights.transport == "broadcast" and rank0 in gpus:
            raise ConfigError(
                f"weights.transport = broadcast: inference server {i} shares GPU {rank0} with trainer rank 0, "
                "and NCCL cannot broadcast between two processes on one GPU; use colocated or auto"
            )
        if weights.transport == "colocated" and not shared:
            raise ConfigError(
                f"weights.transport = colocated: inference server {i} (GPU {', '.join(gpus)}) shares no GPU "
                f"with the trainer ({', '.join(devices.trainer)}); use broadcast or auto"
            )


def plan_run(config: RLConfig, visible_gpus: list[str], cores: int | None = None) -> RunPlan:
    """Resolve `config` against the visible GPUs and CPU cores (default: this process's).

    Raises ConfigError (one line) on any inconsistency.
    """
    dep = config.deployment
    devices = assign_devices(
        visible_gpus, dep.inference_gpus, dep.trainer_gpus, dep.inference_servers, dep.trainer_nproc
    )
    num_servers = len(devices.inference)
    ports = dep.inference_ports or [config.inference.port + i for i in range(num_servers)]
    if len(ports) != num_servers:
        raise ConfigError(
            f"deployment.inference_ports: {len(ports)} port(s) for {num_servers} inference server(s)"
        )

    check_transport(config.weights, devices)
    if config.weights.in_memory:
        host, port = weight_group_address(config)
        config = _update("", config, {"weights": {"host": host, "port": port}})
    link = {k: getattr(config.weights, k) for k in ("transport", "host", "port")}

    shared = {
        "model": config.model,
        "seq_len": config.seq_len,
        "max_steps": config.max_steps,
        "seed": config.seed,
    }
    owned = {"run_dir": config.run_dir}
    inference = _fill(config.inference, "inference", shared, owned)
    inference = _update("inference", inference, _inference_defaults(config, devices))
    per_server = [
        _with_weights(
            "inference", _update("inference", inference, {"port": p}), config, link | {"server_index": i}
        )
        for i, p in enumerate(ports)
    ]

    owned_jobs = owned | {"resume": config.resume}
    servers = [server_url(c) for c in per_server]
    orchestrator = _fill(
        config.orchestrator,
        "orchestrator",
        shared,
        owned_jobs | {"servers": servers, "num_ranks": devices.trainer_nproc},
    )
    if inference.api_key and orchestrator.client.api_key is None:
        orchestrator = _update("orchestrator", orchestrator, {"client": {"api_key": inference.api_key}})
    orchestrator = _with_weights("orchestrator", orchestrator, config, link)
    trainer = _fill(config.trainer, "trainer", shared, owned_jobs)
    trainer = _with_weights("trainer", trainer, config, link | {"num_servers": num_servers})
    inference = per_server[0]
    _check_agreement(inference, orchestrator, trainer)

    resolved = _update("", config, {"inference": inference, "orchestrator": orchestrator, "trainer": trainer})

    threads = cpu_threads(config, devices, cores or usable_cores())
    return RunPlan(resolved, devices, per_server, orchestrator, trainer, threads)


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
    return _update(name, section, updates)


def _with_weights(name: str, section: M, config: RLConfig, owned: dict[str, Any]) -> M:
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
    return _update(name, section, {"weights": merged})


def _inference_defaults(config: RLConfig, devices: DeviceAssignment) -> dict[str, Any]:
    """The server's context length is seq_len; a server sharing a GPU gets a smaller memory share."""
    inf = config.inference
    engine: dict[str, Any] = {}
    vllm: dict[str, Any] = {}
    if inf.engine.max_model_len is None:
        engine["max_model_len"] = config.seq_len
    if inf.vllm.max_model_len is None:
        vllm["max_model_len"] = config.seq_len
    if devices.colocated:
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
    keep, lag = trainer.weights.keep, orchestrator.max_async_level
    if not trainer.weights.in_memory and keep and keep <= lag:
        raise ConfigError(
            f"trainer.weights.keep ({keep}) must exceed orchestrator.max_async_level ({lag}), or be 0 (keep all)"
        )


def _update(name: str, model: M, updates: dict[str, Any]) -> M:
    """A validated copy of `model` with `updates` merged in (nested dicts merge into sub-sections)."""
    data = model.model_dump(exclude_unset=True)
    data = deep_merge(data, updates)
    try:
        return type(model).model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{format_validation_error(e)} (in the resolved {name or 'rl'} config)") from None


def _plain(value: Any) -> Any:
    """A value as the user wrote it, for comparisons and messages."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value) if isinstance(value, Path) else value
