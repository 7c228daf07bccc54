"""Which GPUs each process of an RL run gets.

No GPU: everything runs on CPU. One GPU: the inference server and the trainer share it
(colocated; the launcher then lowers the server's memory budget). Two or more: the first half
serves inference, the rest trains, unless `inference_gpus` / `trainer_gpus` say otherwise.
Inference GPUs are split evenly over the servers (by default one server per GPU); the trainer
runs one rank per GPU.

On a node of a multi-node run (tandem.launch.cluster) the node has one role: an inference node
splits its GPUs evenly over its servers, a trainer node runs one rank per GPU.

GPU ids are the names `CUDA_VISIBLE_DEVICES` uses; each child gets its own list in that variable.
"""

import os
from dataclasses import dataclass

from tandem.config.loader import ConfigError


@dataclass(frozen=True)
class DeviceAssignment:
    """Per inference server, its GPU ids; the trainer's GPU ids. Empty lists mean CPU."""

    inference: list[list[str]]
    trainer: list[str]
    trainer_nproc: int

    @property
    def on_gpu(self) -> bool:
        return bool(self.trainer) or any(self.inference)

    @property
    def colocated(self) -> bool:
        """True when an inference server shares a GPU with the trainer."""
        return any(set(gpus) & set(self.trainer) for gpus in self.inference)


NVIDIA_DRIVER = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0")


def visible_gpus() -> list[str]:
    """The GPUs this launcher may hand out: its own CUDA_VISIBLE_DEVICES, else all it can count."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    if not any(os.path.exists(p) for p in NVIDIA_DRIVER):
        return []  # no driver, no GPU: and no need to import torch (seconds) to learn it
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def assign_devices(
    visible: list[str],
    inference_gpus: list[str] | None,
    trainer_gpus: list[str] | None,
    num_servers: int | None,
    trainer_nproc: int | None,
) -> DeviceAssignment:
    """Resolve the deployment's device settings against the GPUs actually visible."""
    for key, given in (("inference_gpus", inference_gpus), ("trainer_gpus", trainer_gpus)):
        unknown = [g for g in given or [] if g not in visible]
        if unknown:
            shown = ", ".join(visible) or "none"
            raise ConfigError(f"deployment.{key}: GPU(s) {', '.join(unknown)} not visible (visible: {shown})")
        if given is not None and len(set(given)) != len(given):
            raise ConfigError(f"deployment.{key}: a GPU is listed twice ({', '.join(given)})")
    inference, trainer = _default_split(visible, inference_gpus, trainer_gpus)
    if bool(inference) != bool(trainer):
        cpu_side = "trainer" if inference else "inference"
        raise ConfigError(
            f"deployment: the {cpu_side} would run on CPU while the other side has GPUs; "
            "list GPUs for both inference_gpus and trainer_gpus (they may share one)"
        )
    servers = _server_gpus(inference, num_servers)
    return DeviceAssignment(servers, trainer, _trainer_nproc(trainer, trainer_nproc))


def assign_node_devices(
    visible: list[str], gpus_per_node: int | None, role: str, servers: int, ranks: int, node: str
) -> DeviceAssignment:
    """One node of a multi-node run: `servers` inference servers, or `ranks` trainer ranks, or
    (an orchestrator's own pod) nothing on a GPU."""
    if role == "orchestrator":
        return DeviceAssignment([], [], 0)
    if gpus_per_node is None:
        if visible:
            raise ConfigError(
                f"{node} sees {len(visible)} GPU(s) ({', '.join(visible)}) but cluster.gpus_per_node is not "
                "set: the other nodes' addresses depend on it, so give every node's GPU count"
            )
        visible = []
    elif len(visible) < gpus_per_node:
        shown = ", ".join(visible) or "none"
        raise ConfigError(
            f"{node} sees {len(visible)} GPU(s) ({shown}), fewer than cluster.gpus_per_node = {gpus_per_node}"
        )
    gpus = visible[: gpus_per_node or 0]
    if role == "inference":
        return DeviceAssignment(_server_gpus(gpus, servers), [], 0)
    return DeviceAssignment([], gpus, ranks)


def _default_split(
    visible: list[str], inference: list[str] | None, trainer: list[str] | None
) -> tuple[list[str], list[str]]:
    if inference is not None and trainer is not None:
        return inference, trainer
    if inference is not None:
        rest = [g for g in visible if g not in inference]
        return inference, rest or list(inference)
    if trainer is not None:
        rest = [g for g in visible if g not in trainer]
        return rest or list(trainer), trainer
    if len(visible) <= 1:
        return list(visible), list(visible)
    half = len(visible) // 2
    return visible[:half], visible[half:]


def _server_gpus(inference: list[str], num_servers: int | None) -> list[list[str]]:
    if not inference:
        return [[] for _ in range(num_servers or 1)]
    count = num_servers or len(inference)
    if len(inference) % count:
        raise ConfigError(
            f"deployment.inference_servers: {count} server(s) cannot split {len(inference)} inference "
            f"GPU(s) ({', '.join(inference)}) evenly"
        )
    per = len(inference) // count
    return [inference[i * per : (i + 1) * per] for i in range(count)]


def _trainer_nproc(trainer: list[str], nproc: int | None) -> int:
    if not trainer:
        return nproc or 1
    if nproc is not None and nproc != len(trainer):
        raise ConfigError(
            f"deployment.trainer_nproc: {nproc} rank(s) on {len(trainer)} trainer GPU(s) "
            f"({', '.join(trainer)}); the trainer runs one rank per GPU"
        )
    return len(trainer)
