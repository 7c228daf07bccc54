"""The deployment model of a run on several nodes: which node runs what, and every derived address.

A run is either one machine (`[cluster] inference_nodes = 0`: the one-machine launcher's plan) or
`inference_nodes` nodes that run only inference servers plus `trainer_nodes` nodes that run only
the trainer, with the orchestrator on the first node of one of the two kinds or on a node of its
own. Nodes are numbered inference first, then trainer, then the orchestrator's own node: node k
is `hosts[k]`, and under Slurm k is SLURM_NODEID.

A *unit* is one node's share, what one node launcher starts: `inference-I`, `trainer-T` (each may
carry the orchestrator) or `orchestrator`. A node launcher is told its unit by node number
(`--node K`) or by name (`--node trainer-1`: Kubernetes pods, one unit each).

Derived, never typed by hand (all from `hosts` and the ports):
- server URLs: `http://{inference host i}:{inference.port + j}` for server j of inference node i;
- the trainer's rendezvous endpoint: `{first trainer host}:{rdzv_port}` (torchrun's c10d);
- the node roll call: `{first trainer host}:{rdzv_port + 1}` (tandem.launch.rollcall);
- the weights group address: `{rank 0's host}:{weights_group_port}`, where the weight-transfer
  group (trainer rank 0 and the servers) rendezvous; trainer rank 0 hosts its store. torchrun's
  c10d orders the trainer nodes by their address, which each node's launcher gives as its host
  here (`--local-addr`), so rank 0 runs on the trainer node whose host sorts first (`rank0_unit`;
  of equal hosts, the first).
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tandem.config.loader import ConfigError
from tandem.launch.config import ClusterConfig, RLConfig

Role = Literal["inference", "trainer", "orchestrator"]

LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "ramfs", "f2fs", "vfat"}
"""Filesystem types that live on one machine: a run directory there is not shared between nodes."""


@dataclass(frozen=True)
class Unit:
    """One node's share: the inference servers or the trainer of one node (`with_orchestrator`
    when the node carries the orchestrator too), or the orchestrator on its own node."""

    role: Role
    index: int = 0
    with_orchestrator: bool = False

    @property
    def name(self) -> str:
        return "orchestrator" if self.role == "orchestrator" else f"{self.role}-{self.index}"


@dataclass(frozen=True)
class Cluster:
    """A multi-node deployment resolved against the nodes' host names."""

    config: ClusterConfig
    inference_port: int
    hosts: list[str]

    @property
    def num_nodes(self) -> int:
        return len(self.units())

    def units(self) -> list[Unit]:
        """Every node's unit, in node order."""
        cfg = self.config
        units = [Unit("inference", i) for i in range(cfg.inference_nodes)]
        units += [Unit("trainer", t) for t in range(cfg.trainer_nodes)]
        units = [Unit(u.role, u.index, u.index == 0 and u.role == cfg.orchestrator_node) for u in units]
        return units + ([Unit("orchestrator")] if cfg.orchestrator_node == "own" else [])

    def unit(self, node: str | int) -> Unit:
        """The unit of node number `node` (SLURM_NODEID), or of the unit named `node`."""
        units = self.units()
        if isinstance(node, int) or node.isdigit():
            k = int(node)
            if not 0 <= k < len(units):
                raise ConfigError(f"--node {k}: the cluster has nodes 0..{len(units) - 1}")
            return units[k]
        for unit in units:
            if unit.name == node:
                return unit
        raise ConfigError(f"--node {node}: not a node of this cluster ({', '.join(u.name for u in units)})")

    def host(self, unit: Unit) -> str:
        if unit.role == "orchestrator" and self.config.orchestrator_node != "own":
            return self.host(Unit(self.config.orchestrator_node))
        return self.hosts[[u.name for u in self.units()].index(unit.name)]

    def server_ports(self, servers_per_node: int) -> list[int]:
        return [self.inference_port + j for j in range(servers_per_node)]

    def server_urls(self, servers_per_node: int) -> list[str]:
        return [
            f"http://{self.host(Unit('inference', i))}:{port}"
            for i in range(self.config.inference_nodes)
            for port in self.server_ports(servers_per_node)
        ]

    @property
    def trainer_host(self) -> str:
        return self.host(Unit("trainer", 0))

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.trainer_host}:{self.config.rdzv_port}"

    @property
    def rollcall_port(self) -> int:
        return self.config.rdzv_port + 1

    @property
    def rank0_unit(self) -> Unit:
        """The trainer node where torchrun puts rank 0: c10d numbers the nodes in the order of their
        addresses (torchrun_command's `local_addr`, this node's host)."""
        trainers = [Unit("trainer", t) for t in range(self.config.trainer_nodes)]
        return min(trainers, key=lambda u: (self.host(u), u.index))

    @property
    def weights_group_address(self) -> str:
        return f"{self.host(self.rank0_unit)}:{self.config.weights_group_port}"


def is_multi_node(config: RLConfig) -> bool:
    return config.cluster.inference_nodes > 0


def resolve_cluster(config: RLConfig, hosts: list[str] | None = None) -> Cluster:
    """The cluster of a multi-node config, with `hosts` (or cluster.hosts) checked against it."""
    cfg = config.cluster
    hosts = hosts if hosts is not None else cfg.hosts
    nodes = num_nodes(config)
    if hosts is None:
        raise ConfigError(
            f"cluster.hosts is not set: list the {nodes} nodes' host names (inference nodes first), "
            "or start the run through [slurm] or [kubernetes], which fill it in"
        )
    if len(hosts) != nodes:
        own = " + the orchestrator's own node" if cfg.orchestrator_node == "own" else ""
        raise ConfigError(
            f"cluster.hosts lists {len(hosts)} host(s) ({', '.join(hosts)}) for {cfg.inference_nodes} "
            f"inference + {cfg.trainer_nodes} trainer node(s){own}"
        )
    return Cluster(cfg, config.inference.port, list(hosts))


def num_nodes(config: RLConfig) -> int:
    """Nodes of the run: 1 for a one-machine run."""
    cfg = config.cluster
    if not is_multi_node(config):
        return 1
    return cfg.inference_nodes + cfg.trainer_nodes + (cfg.orchestrator_node == "own")


def check_node_shapes(config: RLConfig) -> None:
    """GPU and process counts that cannot fit the nodes fail here, naming the keys."""
    cfg = config.cluster
    gpus = cfg.gpus_per_node or 0
    if not is_multi_node(config):
        for key in (
            "servers_per_node",
            "trainer_ranks_per_node",
            "prefill_servers_per_node",
            "prefill_nodes",
        ):
            if getattr(cfg, key):
                raise ConfigError(
                    f"cluster.{key} applies to several nodes; with cluster.inference_nodes = 0 one node "
                    "runs everything: use deployment.inference_servers / trainer_nproc / prefill_servers"
                )
        if cfg.trainer_nodes > 1 or cfg.orchestrator_node == "own":
            raise ConfigError(
                f"cluster.trainer_nodes = {cfg.trainer_nodes}, orchestrator_node = {cfg.orchestrator_node!r}: "
                "several nodes need the servers on nodes of their own: set cluster.inference_nodes "
                "(cluster.inference_nodes = 0 is one node for everything)"
            )
        return
    single_node_keys = (
        "inference_servers",
        "prefill_servers",
        "inference_ports",
        "trainer_nproc",
        "inference_gpus",
        "trainer_gpus",
    )
    for key in single_node_keys:
        if key in config.deployment.model_fields_set:
            raise ConfigError(
                f"deployment.{key} places processes on one machine; with cluster.inference_nodes = "
                f"{cfg.inference_nodes} use cluster.servers_per_node / cluster.trainer_ranks_per_node / "
                "cluster.gpus_per_node"
            )
    if cfg.prefill_nodes and cfg.prefill_nodes >= cfg.inference_nodes:
        raise ConfigError(
            f"cluster.prefill_nodes = {cfg.prefill_nodes} of {cfg.inference_nodes} inference node(s) leaves "
            "none to decode"
        )
    if cfg.prefill_nodes and cfg.prefill_servers_per_node:
        raise ConfigError(
            "cluster.prefill_nodes and cluster.prefill_servers_per_node both place prefill servers: set one"
        )
    servers = cfg.servers_per_node
    if gpus and servers and gpus % servers:
        raise ConfigError(
            f"cluster.servers_per_node = {servers} cannot split cluster.gpus_per_node = {gpus} GPUs evenly"
        )
    ranks = cfg.trainer_ranks_per_node
    if gpus and ranks is not None and ranks != gpus:
        raise ConfigError(
            f"cluster.trainer_ranks_per_node = {ranks} on nodes of {gpus} GPU(s) (cluster.gpus_per_node): "
            "the trainer runs one rank per GPU"
        )
    ports = set(range(config.inference.port, config.inference.port + servers_per_node(config)))
    taken = ports & {cfg.rdzv_port, cfg.rdzv_port + 1, cfg.weights_group_port}
    if taken:
        raise ConfigError(
            f"inference.port: the servers' ports {min(ports)}..{max(ports)} overlap the cluster's "
            f"port(s) {', '.join(map(str, sorted(taken)))} (cluster.rdzv_port / weights_group_port)"
        )


def servers_per_node(config: RLConfig) -> int:
    cfg = config.cluster
    return cfg.servers_per_node or cfg.gpus_per_node or 1


def trainer_ranks_per_node(config: RLConfig) -> int:
    cfg = config.cluster
    return cfg.trainer_ranks_per_node or cfg.gpus_per_node or 1


def filesystem_type(path: Path) -> tuple[str, str] | None:
    """(type, mount point) of the filesystem holding `path` (or its nearest existing parent)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = Path(os.path.realpath(path))
    best: tuple[str, str] | None = None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        if (target == Path(mount) or Path(mount) in target.parents) and (
            best is None or len(mount) >= len(best[1])
        ):
            best = (fields[2], mount)
    return best


def unshared_run_dir_warning(run_dir: Path) -> str | None:
    """A warning when `run_dir` is on a filesystem only this machine sees (ext4, tmpfs, ...)."""
    found = filesystem_type(run_dir)
    if found is None or found[0] not in LOCAL_FILESYSTEMS:
        return None
    fstype, mount = found
    return (
        f"run_dir {run_dir} is on a local {fstype} filesystem (mounted at {mount}): every node must see "
        "the same run directory; put it on a shared filesystem (NFS, Lustre, GPFS, ...)"
    )
