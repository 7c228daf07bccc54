"""Everything the launcher checks before it starts a process, also under `--dry-run`.

Each failure is one line naming the key or file (UserError / ConfigError): the model source (a
local directory; a hub name, last, in the Hugging Face cache or on a hub that answers), the
run directory (creatable, writable, and not a finished or running run unless --resume), every
environment (its name, its args, a training split that loads and is not empty, the held-out one
too with evaluation on, and for the code environment the sandbox's isolation, which is logged),
the longest prompt plus max_tokens against seq_len, a custom loss's import path, the ports the
run will listen on (planned_ports) and trainer.parallel.ep against the checkpoint's experts;
with [monitor.wandb], that the wandb package is installed, and with model.attention = "cudnn" or
"flash", that backend's package.
Nothing here imports torch unless the configured custom loss does.
"""

import importlib.util
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from tandem.cli import UserError
from tandem.envs.mixture import load_mixture, split_tasks
from tandem.launch.plan import RunPlan
from tandem.models.source import (
    check_expert_parallel,
    check_hub_model,
    check_local_checkpoint,
    check_model_source,
)
from tandem.monitor.wandb_run import require_wandb
from tandem.net import WILDCARD
from tandem.orchestrator.prompt_check import check_prompt_lengths, local_token_counters
from tandem.trainer.rl.config import CustomLoss
from tandem.transport.resume import check_fresh_start


def preflight(plan: RunPlan, create: bool, ports: bool = True) -> None:
    """Raise on the first problem; `create`: then make the run directory (not under --dry-run),
    last, so that a failed check leaves no empty run directory behind. `ports` false: the caller
    checks the run's ports itself (check_ports), later: the launcher, on a run_dir that exists,
    once it holds run_dir/rl.lock (launch/cli.py)."""
    config = plan.config
    check_model_source(plan.orchestrator.model.name)
    check_local_checkpoint(plan.orchestrator.model.name)
    if plan.orchestrator.monitor.wandb_enabled:
        require_wandb()
    if plan.runs_trainer:
        check_attention_package(plan.trainer.model.attention)
        check_expert_parallel(plan.trainer.model.name, plan.trainer.parallel.ep)
    check_run_dir(config.run_dir)
    if not config.resume:
        check_fresh_start(config.run_dir)
    if ports:
        check_ports(plan)
    if isinstance(plan.trainer.loss, CustomLoss):
        check_loss_import(plan.trainer.loss.import_path, plan.trainer.loss.options)
    members = load_mixture(plan.orchestrator.env, plan.orchestrator.envs, "orchestrator.")
    for member in members:
        split_tasks(member, "train")
        if plan.orchestrator.eval.interval:
            split_tasks(member, "eval")
    counters = local_token_counters(plan.orchestrator.model.name)
    if counters is not None:
        for member in members:
            check_prompt_lengths(member.env, plan.orchestrator, *counters)
    check_hub_model(plan.orchestrator.model.name)  # last: the one check that may wait on the network
    if create:
        make_run_dir(config.run_dir)


ATTENTION_PACKAGES = {
    "cudnn": ("cudnn", "NVIDIA's cuDNN frontend: pip install nvidia-cudnn-frontend"),
    "flash": ("flash_attn.cute", "FlashAttention 4: pip install flash-attn-4"),
}
"""The backends of an optional package (models/layers/cudnn_attention.py, flash_attention.py):
the module it provides, and what to install."""


def check_attention_package(attention: str) -> None:
    """model.attention = "cudnn" or "flash" needs its package."""
    if attention not in ATTENTION_PACKAGES:
        return
    module, needs = ATTENTION_PACKAGES[attention]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"model.attention = '{attention}' needs {needs} (or another model.attention)")


def check_run_dir(run_dir: Path) -> None:
    """run_dir exists as a writable directory or can be made."""
    existing = next(p for p in [run_dir, *run_dir.absolute().parents] if p.exists())
    if not existing.is_dir():
        where = "it is a file" if existing == run_dir else f"{existing} is a file"
        raise UserError(f"run_dir {run_dir} cannot be created: {where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == run_dir:
            raise UserError(f"run_dir {run_dir} is not writable")
        raise UserError(f"run_dir {run_dir} cannot be created: {existing} is not writable")


def make_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"run_dir {run_dir} cannot be created: {e.strerror}") from None


@dataclass(frozen=True)
class PlannedPort:
    """A port a process of the run will listen on, fixed before it starts."""

    port: int
    host: str  # where it will be bound ("0.0.0.0": on every address)
    what: str  # who listens there, for messages
    key: str  # the config key(s) that set it


def planned_ports(plan: RunPlan) -> list[PlannedPort]:
    """Every port this machine's processes will bind that the plan fixes now: each server's HTTP
    port; a server's vLLM subprocess's port (inference.vllm.port, when set and the server runs
    vLLM); with an in-memory weights.transport, the weight group's store, which trainer rank 0
    hosts (a TCPStore listens on every address, whatever weights.host says). weights.port is
    probed also when the plan took a free one (0): a resolved config given again fixes it.
    Not here, as nothing fixes them in advance: a multi-rank trainer's rendezvous (torchrun
    --standalone binds localhost:0), the ports vLLM and the prefill links open for themselves.

    On one node of several (plan.unit), only what binds on this node: an inference node's servers
    (inference.port + j); the first trainer node, the node roll call its launcher hosts
    (rdzv_port + 1) and with several trainer nodes torchrun's c10d rendezvous (rdzv_port, whose
    store the agent there hosts); rank 0's node (Cluster.rank0_unit), with an in-memory transport,
    the weight group's store (weights_group_port). The other trainer nodes bind none of these."""
    cluster = plan.cluster
    server_keys = "inference.port" if cluster else "deployment.inference_ports / inference.port"
    ports = []
    vllm = [i for i, cfg in enumerate(plan.inference) if cfg.vllm.port and runs_vllm(cfg.backend, plan)]
    for i, cfg in enumerate(plan.inference):
        name = f"inference server {i}"
        ports.append(PlannedPort(cfg.port, cfg.host, name, server_keys))
        if i in vllm:
            ports.append(PlannedPort(cfg.vllm.port, "127.0.0.1", f"{name}'s vLLM", "inference.vllm.port"))
    weights = plan.trainer.weights
    if cluster is None:
        if plan.runs_trainer and weights.in_memory and weights.port:
            what = "the weight group's store, which trainer rank 0 hosts on every address"
            ports.append(PlannedPort(weights.port, "0.0.0.0", what, "weights.port"))
        return ports
    if plan.unit is None or plan.unit.role != "trainer":
        return ports
    cfg = cluster.config
    if plan.unit.index == 0:
        if cfg.trainer_nodes > 1:
            what = "the trainer's rendezvous (torchrun's c10d store), which trainer-0 hosts"
            ports.append(PlannedPort(cfg.rdzv_port, "0.0.0.0", what, "cluster.rdzv_port"))
        what = "the node roll call, which trainer-0's launcher hosts"
        key = "cluster.rdzv_port (the roll call takes the port after it)"
        ports.append(PlannedPort(cluster.rollcall_port, "0.0.0.0", what, key))
    if weights.in_memory and plan.unit.name == cluster.rank0_unit.name:
        what = f"the weight group's store, which trainer rank 0 hosts on {plan.unit.name}"
        ports.append(PlannedPort(cfg.weights_group_port, "0.0.0.0", what, "cluster.weights_group_port"))
    return ports


def runs_vllm(backend: str, plan: RunPlan) -> bool:
    """Whether a server of `backend` will run vLLM (as tandem.inference.cli.pick_backend decides,
    with the plan's GPUs for torch.cuda.is_available(), which this module does not import)."""
    if backend != "auto":
        return backend == "vllm"
    return plan.devices.on_gpu and importlib.util.find_spec("vllm") is not None


def check_ports(plan: RunPlan) -> None:
    """Each planned port (planned_ports: on one node of several, that node's) is the plan's only
    listener there and can be bound now (probe_ports)."""
    for cfg in plan.inference:
        if cfg.port == 0:  # (a plan may render a server's section with 0; a run cannot start it)
            raise UserError(
                "inference.port = 0 (any free port) leaves the launcher no server URL to wait for: "
                + ("give a port" if plan.cluster else "give a port (or deployment.inference_ports)")
            )
    ports = planned_ports(plan)
    vllm = [p for p in ports if p.key == "inference.vllm.port"]
    if len(vllm) > 1:
        raise UserError(
            f"inference.vllm.port = {vllm[0].port} is the vLLM port of each of the {len(vllm)} servers "
            "on vLLM: set it to 0 (a free port for each)"
        )
    probe_ports(ports)


def probe_ports(ports: list[PlannedPort]) -> None:
    """Each port is planned once (a port on every address clashes with it on any one) and can be
    bound now, as its process will bind it (SO_REUSEADDR: a closed connection's TIME_WAIT does not
    hold it); else a UserError naming the port, what will listen there and the key that sets it."""
    for i, a in enumerate(ports):
        for b in ports[:i]:
            if a.port == b.port and (a.host == b.host or a.host in WILDCARD or b.host in WILDCARD):
                keys = a.key if a.key == b.key else f"{b.key} or {a.key}"
                raise UserError(f"port {a.port} is planned both for {b.what} and for {a.what}: set {keys}")
    for planned in ports:
        family = socket.AF_INET6 if ":" in planned.host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the process will
            try:
                probe.bind((planned.host, planned.port))
            except OSError as e:
                raise UserError(
                    f"port {planned.port} on {planned.host} is taken ({e.strerror}), for {planned.what}; "
                    f"stop what uses it or set {planned.key}"
                ) from None


def check_loss_import(import_path: str, options: dict) -> None:
    """The module must exist (found without importing it), then import with its attribute, which
    must take `options` (trainer.loss.options) as keyword arguments."""
    module = import_path.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as e:
        raise UserError(f"trainer.loss.import_path '{import_path}' cannot be imported: {e}") from None
    if not found:
        raise UserError(
            f"trainer.loss.import_path '{import_path}' cannot be imported: no module named '{module}'"
        )
    from tandem.trainer.rl.loss import check_options, import_objective

    try:
        check_options(import_objective(import_path), import_path, options)
    except UserError as e:
        raise UserError(f"trainer.{e}") from None
