"""From one RLConfig to the per-process configs and commands of a run, or of one node's share.

The launcher owns the fields that connect the processes: each server's port, the orchestrator's
server URLs and rank count, run_dir and resume (tandem.launch.sections fills and checks each
process's section). On several nodes (tandem.launch.cluster) every
node resolves the whole run the same way and starts only its own processes.
"""

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config.loader import ConfigError, to_toml
from tandem.inference.config import InferenceConfig
from tandem.launch.cluster import Cluster, Unit, check_node_shapes, servers_per_node, trainer_ranks_per_node
from tandem.launch.config import RLConfig
from tandem.launch.devices import DeviceAssignment, assign_devices, assign_node_devices
from tandem.launch.sections import inference_section, process_sections, updated, with_weights
from tandem.launch.supervisor import Console, ProcessSpec, Supervisor
from tandem.monitor.wandb_run import RUN_CONFIG_ENV
from tandem.net import free_port
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.transport.config import WeightsConfig
from tandem.transport.layout import written_steps
from tandem.transport.resume import trainer_start
from tandem.transport.weights import STABLE, latest_version, weights_dir

INFERENCE_MODULE = "tandem.inference.cli"
ORCHESTRATOR_MODULE = "tandem.orchestrator.cli"
TRAINER_MODULE = "tandem.trainer.rl.cli"


@dataclass
class RunPlan:
    config: RLConfig  # as resolved: what run_dir/configs/rl.toml holds
    devices: DeviceAssignment
    inference: list[InferenceConfig]
    orchestrator: OrchestratorConfig
    trainer: RLTrainerConfig
    cpu_threads: int | None = None  # OMP_NUM_THREADS of each server and trainer rank (CPU runs)
    unit: Unit | None = None  # on several nodes: what this node launcher starts; None: everything
    cluster: Cluster | None = None

    @property
    def config_dir(self) -> Path:
        return self.config.run_dir / "configs" / (self.unit.name if self.unit else "")

    @property
    def log_dir(self) -> Path:
        return self.config.run_dir / "logs" / (self.unit.name if self.unit else "")

    @property
    def runs_trainer(self) -> bool:
        return self.unit is None or self.unit.role == "trainer"

    @property
    def runs_orchestrator(self) -> bool:
        return self.unit is None or self.unit.role == "orchestrator" or self.unit.with_orchestrator

    def files(self) -> dict[str, str]:
        """run_dir/configs/[<unit>/]<name>.toml → its text (this node's processes only)."""
        texts = {f"inference_{i}": to_toml(c) for i, c in enumerate(self.inference)}
        if self.runs_orchestrator:
            texts["orchestrator"] = to_toml(self.orchestrator)
        if self.runs_trainer:
            texts["trainer"] = to_toml(self.trainer)
        texts["rl"] = to_toml(self.config)
        return texts

    def write_configs(self) -> None:
        self.config_dir.mkdir(parents=True, exist_ok=True)
        for name, text in self.files().items():
            path = self.config_dir / f"{name}.toml"
            tmp = path.with_suffix(".toml.tmp")
            try:
                tmp.write_text(text)
            except OSError as e:  # (a full disk: no half-written file left behind)
                tmp.unlink(missing_ok=True)
                raise OSError(e.errno, e.strerror, str(path)) from None
            tmp.replace(path)

    def specs(self) -> list[ProcessSpec]:
        """The processes to start here, servers first, each pinned to its devices."""
        python = sys.executable
        specs = []
        for i, (cfg, gpus) in enumerate(zip(self.inference, self.devices.inference, strict=True)):
            specs.append(
                ProcessSpec(
                    f"inference_{i}" if len(self.inference) > 1 else "inference",
                    [python, "-m", INFERENCE_MODULE, "@", str(self.config_dir / f"inference_{i}.toml")],
                    env={"CUDA_VISIBLE_DEVICES": ",".join(self._visible_gpus(cfg, gpus))} | self._threads(),
                    role="service",
                    health_url=f"{local_url(cfg)}/health",
                )
            )
        if self.runs_trainer:
            specs.append(
                ProcessSpec(
                    "trainer",
                    [
                        *self.trainer_runner(),
                        "-m",
                        TRAINER_MODULE,
                        "@",
                        str(self.config_dir / "trainer.toml"),
                    ],
                    env={"CUDA_VISIBLE_DEVICES": ",".join(self.devices.trainer)} | self._threads(),
                    check_done=self._check_done(trainer_left_waiting, self.orchestrator.weights.wait_timeout),
                )
            )
        if self.runs_orchestrator:
            remote = [] if self.unit is None else [f"{url}/health" for url in self.orchestrator.servers]
            specs.append(
                ProcessSpec(
                    "orchestrator",
                    [python, "-m", ORCHESTRATOR_MODULE, "@", str(self.config_dir / "orchestrator.toml")],
                    env={"CUDA_VISIBLE_DEVICES": "", RUN_CONFIG_ENV: str(self.config_dir / "rl.toml")},
                    wait_for=remote,
                    check_done=self._check_done(orchestrator_left_waiting, self.trainer.rollout_timeout_s),
                )
            )
        return specs

    def _check_done(
        self, left_waiting: Callable[[Path, int, float], str | None], timeout_s: float
    ) -> Callable[[], str | None] | None:
        """On one machine: the check of a job that exits 0 while the other runs. (On several nodes
        the two are not in one launcher, and a shared filesystem may show the other node's files late.)"""
        if self.unit is not None:
            return None
        return lambda: left_waiting(self.config.run_dir, self.config.max_steps, timeout_s)

    def _visible_gpus(self, cfg: InferenceConfig, gpus: list[str]) -> list[str]:
        """A server's GPUs, then those of its prefill servers when it maps their staging buffers
        (CUDA IPC needs them visible; the server runs on the first)."""
        visible = list(gpus)
        if cfg.prefill.transport == "shared":
            urls = [local_url(c) for c in self.inference]
            for url in cfg.prefill.servers:
                if url in urls:
                    visible += [g for g in self.devices.inference[urls.index(url)] if g not in visible]
        return visible

    def supervisor(
        self,
        console: Console,
        prog: str,
        peer_event: Callable[[], tuple[str, str] | None] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> Supervisor:
        """The supervisor of this plan's processes, with the deployment's timeouts; `pass_fds` are
        inherited by every process (the run_dir lock)."""
        return Supervisor(
            self.specs(),
            self.log_dir,
            startup_timeout_s=self.config.deployment.startup_timeout_s,
            shutdown_grace_s=self.config.deployment.shutdown_grace_s,
            console=console,
            prog=prog,
            peer_event=peer_event,
            pass_fds=pass_fds,
        )

    def trainer_runner(self) -> list[str]:
        """How this node starts its trainer ranks: python, torchrun --standalone, or a torchrun
        agent of a c10d rendezvous over the trainer nodes."""
        nnodes = self.cluster.config.trainer_nodes if self.cluster else 1
        endpoint = self.cluster.rdzv_endpoint if self.cluster else None
        timeout = self.config.cluster.join_timeout_s
        here = self.cluster.host(self.unit) if self.cluster and self.unit else None
        return torchrun_command(self.devices.trainer_nproc, nnodes, endpoint, timeout, here)

    def _threads(self) -> dict[str, str]:
        return {} if self.cpu_threads is None else {"OMP_NUM_THREADS": str(self.cpu_threads)}


def orchestrator_left_waiting(run_dir: Path, max_steps: int, rollout_timeout_s: float) -> str | None:
    """Why an orchestrator that exited 0 while the trainer runs left it waiting, or None: it must
    have written the last step's rollouts (which the trainer keeps, as the run's marker), unless
    the trainer had trained every step already."""
    written = written_steps(run_dir)
    if max_steps - 1 in written or trainer_start(run_dir) >= max_steps:
        return None
    return (
        f"before writing the rollouts of step {max_steps - 1} (the last written: "
        f"{f'step {written[-1]}' if written else 'none'}); the trainer would have waited "
        f"trainer.rollout_timeout_s={rollout_timeout_s:g} for them"
    )


def trainer_left_waiting(run_dir: Path, max_steps: int, wait_timeout_s: float) -> str | None:
    """Why a trainer that exited 0 while the orchestrator runs left it waiting, or None: it must
    have published weights/step_{max_steps} (every transport writes the last version to disk),
    unless it had nothing left to train."""
    if (weights_dir(run_dir, max_steps) / STABLE).is_file() or trainer_start(run_dir) >= max_steps:
        return None
    newest = latest_version(run_dir)
    return (
        f"before publishing weights/step_{max_steps} (the newest: "
        f"{'none' if newest is None else f'step_{newest}'}); the orchestrator would have waited "
        f"weights.wait_timeout={wait_timeout_s:g} for them"
    )


def torchrun_command(
    nproc: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    join_timeout_s: float = 600,
    local_addr: str | None = None,
) -> list[str]:
    """The command that starts `nproc` ranks here, before `-m MODULE ...`: plain python for one
    rank on one node; with several nodes one torchrun agent per node, all meeting at the c10d
    rendezvous on `rdzv_endpoint`. c10d numbers the nodes in the order of their addresses: this
    node's is `local_addr` (its host in cluster.hosts; default its FQDN), so the node whose host
    sorts first gets rank 0 (Cluster.rank0_unit)."""
    python = sys.executable
    if nnodes == 1:
        return (
            [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            if nproc > 1
            else [python]
        )
    if rdzv_endpoint is None:
        raise ValueError("several trainer nodes need a rendezvous endpoint")
    return [
        *(python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=tandem"),
        *(f"--rdzv-conf=join_timeout={round(join_timeout_s)}", "--max-restarts=0"),
        *([f"--local-addr={local_addr}"] if local_addr else []),
    ]


def cpu_threads(config: RLConfig, devices: DeviceAssignment, cores: int) -> int | None:
    """On CPU runs, split the cores between the servers and the trainer ranks, as torchrun does
    between its ranks: several processes each using every core oversubscribe the CPU."""
    if devices.on_gpu:
        return None
    if config.deployment.cpu_threads is not None:
        return config.deployment.cpu_threads
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, cores // max(1, len(devices.inference) + devices.trainer_nproc))


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: respects taskset and cpusets
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_url(cfg: InferenceConfig) -> str:
    """The URL of a server on this machine."""
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    return f"http://{host}:{cfg.port}"


def plan_run(config: RLConfig, visible_gpus: list[str], cores: int | None = None) -> RunPlan:
    """Resolve `config` for one machine against the visible GPUs and CPU cores (default: this
    process's). Raises ConfigError (one line) on any inconsistency."""
    check_node_shapes(config)
    if config.cluster.inference_nodes:
        raise ConfigError(
            f"cluster.inference_nodes = {config.cluster.inference_nodes}: a run on several nodes starts "
            "through [slurm], [kubernetes] (--k8s), or one `python -m tandem.launch.node` per node "
            "(docs/scaling.md)"
        )
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
    config, link = _weight_link(config, weight_group_address(config))
    inference = inference_section(config, devices.colocated)
    per_server = [
        with_weights(
            "inference", updated("inference", inference, {"port": p}), config, link | {"server_index": i}
        )
        for i, p in enumerate(ports)
    ]
    servers = [local_url(c) for c in per_server]
    k = dep.prefill_servers
    per_server = _with_prefill(config, per_server, k, "deployment.prefill_servers")
    servers, prefill = (servers[:-k], servers[-k:]) if k else (servers, [])
    resolved, orchestrator, trainer = process_sections(
        config, per_server, servers, devices.trainer_nproc, link, prefill
    )
    threads = cpu_threads(config, devices, cores or usable_cores())
    return RunPlan(resolved, devices, per_server, orchestrator, trainer, threads)


def _with_prefill(
    config: RLConfig, per_server: list[InferenceConfig], k: int, key: str
) -> list[InferenceConfig]:
    """With `key` = K > 0, the last K of one machine's servers compute prompts for the others
    (their prefill.servers, through staging buffers unless inference.prefill.transport says
    otherwise); every server runs the native engine. Returns the servers' sections."""
    if not k:
        return per_server
    if k >= len(per_server):
        raise ConfigError(f"{key} = {k} of {len(per_server)} inference server(s) leaves none to decode")
    derived = [local_url(c) for c in per_server[-k:]]
    # (one machine: the blocks move through staging buffers)
    return _decode_servers(config, per_server[:-k], derived, key, "shared") + _native(per_server[-k:])


def _decode_servers(
    config: RLConfig, per_server: list[InferenceConfig], prefill_urls: list[str], key: str, transport: str
) -> list[InferenceConfig]:
    """Servers whose prompts the servers at `prefill_urls` compute (derived from `key`), their
    blocks coming by `transport` unless inference.prefill.transport says otherwise."""
    if config.inference.prefill.servers not in ([], prefill_urls):  # (a resolved config repeats them)
        raise ConfigError(
            f"inference.prefill.servers = {config.inference.prefill.servers} conflicts with {prefill_urls}, "
            f"which the launcher derives from {key}; set that instead"
        )
    if not all(c.engine.prefix_caching for c in per_server):
        raise ConfigError(
            f"{key} needs the prefix cache, which is off (engine.prefix_caching = false, "
            "or orchestrator.seeded_sampling, which turns it off): prompts enter the decode servers through it"
        )
    if config.inference.backend == "vllm":
        raise ConfigError(f"{key} needs the native engine; inference.backend is 'vllm'")
    section: dict[str, Any] = {"servers": prefill_urls}
    if "transport" not in config.inference.prefill.model_fields_set:
        section["transport"] = transport
    return [updated("inference", c, {"prefill": section}) for c in _native(per_server)]


def _native(per_server: list[InferenceConfig]) -> list[InferenceConfig]:
    return [updated("inference", c, {"backend": "native"}) for c in per_server]  # (auto could pick vLLM)


def plan_node(
    config: RLConfig, cluster: Cluster, unit: Unit, visible_gpus: list[str], cores: int | None = None
) -> RunPlan:
    """Resolve `config` for one unit of a multi-node run: every node derives the same server
    URLs and rank count from the cluster, and keeps only its own processes."""
    check_node_shapes(config)
    servers, ranks = servers_per_node(config), trainer_ranks_per_node(config)
    where = f"{unit.name} ({cluster.host(unit)})"
    devices = assign_node_devices(
        visible_gpus, config.cluster.gpus_per_node, unit.role, servers, ranks, where
    )
    inference = inference_section(config, colocated=False)
    if "host" not in config.inference.model_fields_set:  # other nodes must reach the servers
        inference = updated("inference", inference, {"host": "0.0.0.0"})
    host, port = cluster.weights_group_address.rsplit(":", 1)
    config, link = _weight_link(config, (host, int(port)))
    here = cluster.server_ports(servers) if unit.role == "inference" else []
    first = (
        unit.index * servers if unit.role == "inference" else 0
    )  # global index of this node's first server
    per_server = [
        with_weights(
            "inference",
            updated("inference", inference, {"port": p}),
            config,
            link | {"server_index": first + i},
        )
        for i, p in enumerate(here)
    ]
    k = config.cluster.prefill_servers_per_node
    if per_server:
        per_server = _with_prefill(config, per_server, k, "cluster.prefill_servers_per_node")
    num_ranks = ranks * cluster.config.trainer_nodes
    urls = cluster.server_urls(servers)
    decode = [url for i, url in enumerate(urls) if i % servers < servers - k]
    prefill = [url for i, url in enumerate(urls) if i % servers >= servers - k]
    if config.cluster.prefill_nodes:  # the last inference nodes compute the others' prompts
        first = (cluster.config.inference_nodes - config.cluster.prefill_nodes) * servers
        decode, prefill = urls[:first], urls[first:]
        if unit.role == "inference" and unit.index * servers < first:
            per_server = _decode_servers(config, per_server, prefill, "cluster.prefill_nodes", "p2p")
        else:
            per_server = _native(per_server)
    resolved, orchestrator, trainer = process_sections(
        config, per_server or [inference], decode, num_ranks, link, prefill
    )
    threads = cpu_threads(config, devices, cores or usable_cores())
    return RunPlan(resolved, devices, per_server, orchestrator, trainer, threads, unit, cluster)


def weight_group_address(config: RLConfig) -> tuple[str, int]:
    """Where trainer rank 0 hosts the weight group's store on one machine: weights.host (default
    127.0.0.1) and weights.port, else a free one. Several nodes take the cluster's address."""
    return config.weights.host, config.weights.port or free_port(config.weights.host)


def _weight_link(config: RLConfig, address: tuple[str, int]) -> tuple[RLConfig, dict[str, Any]]:
    """The config with the weight group's address filled in (in-memory transports), and the
    weights fields every process must agree on."""
    if config.weights.in_memory:
        config = updated("", config, {"weights": {"host": address[0], "port": address[1]}})
    return config, {k: getattr(config.weights, k) for k in ("transport", "host", "port")}


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
