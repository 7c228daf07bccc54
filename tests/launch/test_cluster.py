"""The multi-node deployment model: units, derived addresses, each node's processes, bad input."""

import re
import sys
from pathlib import Path

import pytest

from tandem.config.loader import ConfigError, build_config
from tandem.launch.cluster import Unit, filesystem_type, resolve_cluster, unshared_run_dir_warning
from tandem.launch.config import RLConfig
from tandem.launch.jobs import check_plans
from tandem.launch.plan import plan_node, plan_run
from tandem.launch.preflight import planned_ports

HOSTS = ["inf-a", "inf-b", "train-a", "train-b"]


def config(tmp_path: Path, **overrides: object) -> RLConfig:
    base = {"model.name": "tiny", "run_dir": str(tmp_path / "run"), "max_steps": 3, "seq_len": 256}
    base |= {"cluster.inference_nodes": 2, "cluster.trainer_nodes": 2, "cluster.hosts": HOSTS}
    return build_config(RLConfig, overrides=list((base | overrides).items()))


def test_units_and_derived_addresses(tmp_path: Path) -> None:
    cfg = config(tmp_path, **{"cluster.gpus_per_node": 4, "cluster.servers_per_node": 2})
    cluster = resolve_cluster(cfg)
    assert [u.name for u in cluster.units()] == ["inference-0", "inference-1", "trainer-0", "trainer-1"]
    assert cluster.unit(0) == Unit("inference", 0, with_orchestrator=True)
    assert cluster.unit("3") == cluster.unit("trainer-1") == Unit("trainer", 1)
    assert cluster.host(Unit("trainer", 1)) == "train-b" and cluster.host(Unit("orchestrator")) == "inf-a"
    assert cluster.server_urls(2) == [
        "http://inf-a:8000",
        "http://inf-a:8001",
        "http://inf-b:8000",
        "http://inf-b:8001",
    ]
    assert cluster.rdzv_endpoint == "train-a:29400" and cluster.rollcall_port == 29401
    assert cluster.weights_group_address == "train-a:29500"

    own = resolve_cluster(
        config(tmp_path, **{"cluster.orchestrator_node": "own", "cluster.hosts": HOSTS + ["o"]})
    )
    assert own.unit(4) == Unit("orchestrator") and own.host(Unit("orchestrator")) == "o"
    assert not any(u.with_orchestrator for u in own.units())


def test_each_node_starts_its_own_processes(tmp_path: Path) -> None:
    cfg = config(tmp_path, **{"cluster.gpus_per_node": 4, "cluster.servers_per_node": 2})
    cluster = resolve_cluster(cfg)
    gpus = ["0", "1", "2", "3"]
    run = tmp_path / "run"

    first = plan_node(cfg, cluster, cluster.unit(0), gpus, cores=8)
    specs = {s.name: s for s in first.specs()}
    assert list(specs) == ["inference_0", "inference_1", "orchestrator"]
    assert [specs[f"inference_{j}"].env["CUDA_VISIBLE_DEVICES"] for j in (0, 1)] == ["0,1", "2,3"]
    assert [c.host for c in first.inference] == ["0.0.0.0", "0.0.0.0"]  # reachable from other nodes
    assert specs["inference_1"].health_url == "http://127.0.0.1:8001/health"
    assert specs["orchestrator"].wait_for == [f"{u}/health" for u in cluster.server_urls(2)]
    assert first.orchestrator.servers == cluster.server_urls(2) and first.orchestrator.num_ranks == 8
    assert (
        first.config_dir == run / "configs" / "inference-0" and first.log_dir == run / "logs" / "inference-0"
    )
    assert sorted(first.files()) == ["inference_0", "inference_1", "orchestrator", "rl"]

    second = plan_node(cfg, cluster, cluster.unit(1), gpus)
    assert [s.name for s in second.specs()] == ["inference_0", "inference_1"]

    trainer = plan_node(cfg, cluster, cluster.unit("trainer-1"), gpus + ["4"])
    (spec,) = trainer.specs()
    assert spec.name == "trainer" and spec.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    weights = trainer.trainer.weights  # the weight group meets at rank 0's node: train-a sorts first
    assert (weights.host, weights.port, weights.num_servers) == ("train-a", 29500, 4)
    assert [(c.weights.host, c.weights.port, c.weights.server_index) for c in second.inference] == [
        ("train-a", 29500, 2),
        ("train-a", 29500, 3),
    ]
    assert spec.argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert spec.argv[3:11] == [
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=train-a:29400",
        "--rdzv-id=tandem",
        "--rdzv-conf=join_timeout=600",
        "--max-restarts=0",
        "--local-addr=train-b",  # (c10d numbers the nodes by it: rank 0 on train-a, which sorts first)
    ]
    assert spec.argv[11:] == ["-m", "tandem.trainer.rl.cli", "@", str(run / "configs/trainer-1/trainer.toml")]
    assert sorted(trainer.files()) == ["rl", "trainer"]


def test_each_node_checks_the_ports_it_binds_and_no_other(tmp_path: Path) -> None:
    """Servers' ports on the inference nodes; the roll call, the rendezvous and the weight group's
    store on the first trainer node, whose host the cluster's addresses name; none on trainer-1."""
    cfg = config(tmp_path, **{"cluster.gpus_per_node": 2, "cluster.servers_per_node": 2})
    cluster = resolve_cluster(cfg)
    planned = {
        unit.name: [(p.port, p.host, p.key) for p in planned_ports(plan_node(cfg, cluster, unit, ["0", "1"]))]
        for unit in cluster.units()
    }
    servers = [(8000, "0.0.0.0", "inference.port"), (8001, "0.0.0.0", "inference.port")]
    assert planned == {
        "inference-0": servers,
        "inference-1": servers,
        "trainer-0": [
            (29400, "0.0.0.0", "cluster.rdzv_port"),
            (29401, "0.0.0.0", "cluster.rdzv_port (the roll call takes the port after it)"),
            (29500, "0.0.0.0", "cluster.weights_group_port"),
        ],
        "trainer-1": [],
    }
    one_trainer = {"cluster.trainer_nodes": 1, "cluster.hosts": HOSTS[:3]}
    for overrides, ports in (
        (one_trainer, [29401, 29500]),  # one trainer node: torchrun --standalone, no rendezvous port
        (one_trainer | {"weights.transport": "filesystem"}, [29401]),  # no weight group
    ):
        cfg = config(tmp_path, **overrides)
        cluster = resolve_cluster(cfg)
        trainer = plan_node(cfg, cluster, cluster.unit("trainer-0"), [])
        assert [p.port for p in planned_ports(trainer)] == ports, overrides


def test_the_weight_group_meets_where_rank_0_runs(tmp_path: Path) -> None:
    """torchrun's c10d gives rank 0 to the trainer node whose address (--local-addr, its host)
    sorts first, here trainer-1; rank 0 hosts the weight group's store, so its address and the
    port check follow it there, while the roll call and the rendezvous stay on trainer-0."""
    hosts = ["inf-a", "inf-b", "train-b", "train-a"]
    cfg = config(tmp_path, **{"cluster.hosts": hosts, "cluster.gpus_per_node": 1})
    cluster = resolve_cluster(cfg)
    assert cluster.rank0_unit.name == "trainer-1" and cluster.rdzv_endpoint == "train-b:29400"
    plans = {u.name: plan_node(cfg, cluster, u, ["0"]) for u in cluster.units()}
    assert {(c.weights.host, c.weights.port) for c in plans["inference-0"].inference} == {("train-a", 29500)}
    assert (plans["trainer-0"].trainer.weights.host, plans["trainer-0"].trainer.weights.port) == (
        "train-a",
        29500,
    )
    assert [p.port for p in planned_ports(plans["trainer-0"])] == [29400, 29401]
    assert [p.port for p in planned_ports(plans["trainer-1"])] == [29500]
    (spec,) = plans["trainer-1"].specs()
    assert "--local-addr=train-a" in spec.argv
    equal = resolve_cluster(config(tmp_path, **{"cluster.hosts": ["h"] * 4}))
    assert equal.rank0_unit.name == "trainer-0"  # (equal hosts: one machine, any node will do)


def test_prefill_servers_on_each_inference_node(tmp_path: Path) -> None:
    """cluster.prefill_servers_per_node = 1 of 4: on each inference node the last server computes
    the node's other three servers' prompts through its staging buffers (loopback URL, its GPU
    visible to them); the orchestrator sends rollouts to the six decode servers and weights to all."""
    cfg = config(tmp_path, **{"cluster.gpus_per_node": 4, "cluster.prefill_servers_per_node": 1})
    cluster = resolve_cluster(cfg)
    node = plan_node(cfg, cluster, cluster.unit(1), ["0", "1", "2", "3"])
    assert [c.prefill.servers for c in node.inference] == [["http://127.0.0.1:8003"]] * 3 + [[]]
    assert {c.prefill.transport for c in node.inference[:3]} == {"shared"}
    specs = {s.name: s for s in node.specs()}
    assert [specs[f"inference_{j}"].env["CUDA_VISIBLE_DEVICES"] for j in range(4)] == [
        "0,3",
        "1,3",
        "2,3",
        "3",
    ]
    urls = cluster.server_urls(4)
    assert node.orchestrator.servers == urls[0:3] + urls[4:7]
    assert node.orchestrator.prefill_servers == [urls[3], urls[7]]
    trainer = plan_node(cfg, cluster, cluster.unit("trainer-0"), ["0", "1", "2", "3"])
    assert trainer.trainer.weights.num_servers == 8
    with pytest.raises(ConfigError, match="cluster.prefill_servers_per_node = 4 of 4 inference server"):
        check_plans(config(tmp_path, **{"cluster.gpus_per_node": 4, "cluster.prefill_servers_per_node": 4}))


def test_prefill_nodes(tmp_path: Path) -> None:
    """cluster.prefill_nodes = 1 of 3 inference nodes: the last node's servers compute the first
    two nodes' prompts, whose servers take the blocks over p2p links and see only their own GPUs;
    the orchestrator sends rollouts to the decode nodes' servers and weights to all."""
    hosts = ["inf-a", "inf-b", "inf-c", "train-a"]
    overrides = {"cluster.inference_nodes": 3, "cluster.trainer_nodes": 1, "cluster.hosts": hosts}
    cfg = config(tmp_path, **overrides, **{"cluster.gpus_per_node": 2, "cluster.prefill_nodes": 1})
    cluster = resolve_cluster(cfg)
    urls = cluster.server_urls(2)
    prefill_urls = ["http://inf-c:8000", "http://inf-c:8001"]
    for index in (0, 1):
        node = plan_node(cfg, cluster, cluster.unit(index), ["0", "1"])
        assert [c.prefill.servers for c in node.inference] == [prefill_urls] * 2
        assert {(c.prefill.transport, c.backend) for c in node.inference} == {("p2p", "native")}
        specs = {s.name: s for s in node.specs()}
        assert [specs[f"inference_{j}"].env["CUDA_VISIBLE_DEVICES"] for j in (0, 1)] == ["0", "1"]
    prefill = plan_node(cfg, cluster, cluster.unit(2), ["0", "1"])
    assert [c.prefill.servers for c in prefill.inference] == [[], []]
    assert {c.backend for c in prefill.inference} == {"native"}
    orchestrator = plan_node(cfg, cluster, cluster.unit(0), ["0", "1"]).orchestrator
    assert orchestrator.servers == urls[:4] and orchestrator.prefill_servers == prefill_urls
    trainer = plan_node(cfg, cluster, cluster.unit("trainer-0"), ["0", "1"])
    assert trainer.trainer.weights.num_servers == 6
    for bad, message in (
        (
            {"cluster.prefill_nodes": 3},
            "cluster.prefill_nodes = 3 of 3 inference node.s. leaves none to decode",
        ),
        (
            {"cluster.prefill_nodes": 1, "cluster.prefill_servers_per_node": 1},
            "cluster.prefill_nodes and cluster.prefill_servers_per_node both place prefill servers",
        ),
        (
            {"cluster.prefill_nodes": 1, "inference.backend": "vllm"},
            "cluster.prefill_nodes needs the native engine",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            check_plans(config(tmp_path, **overrides, **{"cluster.gpus_per_node": 2, **bad}))


def test_cpu_nodes(tmp_path: Path) -> None:
    cfg = config(tmp_path, **{"cluster.trainer_ranks_per_node": 2})
    cluster = resolve_cluster(cfg)
    plan = plan_node(cfg, cluster, cluster.unit("trainer-0"), [], cores=6)
    assert plan.devices.trainer_nproc == 2 and plan.cpu_threads == 3
    assert plan_node(cfg, cluster, cluster.unit(0), []).orchestrator.num_ranks == 4


@pytest.mark.parametrize(
    ("overrides", "visible", "message"),
    [
        (
            {"cluster.gpus_per_node": 8, "cluster.servers_per_node": 3},
            8,
            "cluster.servers_per_node = 3 cannot split cluster.gpus_per_node = 8 GPUs evenly",
        ),
        (
            {"cluster.gpus_per_node": 8, "cluster.trainer_ranks_per_node": 4},
            8,
            "cluster.trainer_ranks_per_node = 4 on nodes of 8 GPU(s) (cluster.gpus_per_node)",
        ),
        ({"cluster.gpus_per_node": 8}, 4, "trainer-0 (train-a) sees 4 GPU(s) (0, 1, 2, 3), fewer than"),
        ({}, 2, "trainer-0 (train-a) sees 2 GPU(s) (0, 1) but cluster.gpus_per_node is not set"),
        ({"deployment.trainer_gpus": [0]}, 0, "deployment.trainer_gpus places processes on one machine"),
        (
            {"cluster.hosts": ["a", "b"]},
            0,
            "cluster.hosts lists 2 host(s) (a, b) for 2 inference + 2 trainer",
        ),
        ({"inference.port": 29399, "cluster.servers_per_node": 2}, 0, "overlap the cluster's port(s) 29400"),
        (
            {"cluster.weights_group_port": 29401},
            0,
            "cluster.weights_group_port (29401) collides with the trainer's rendezvous (29400) or its node "
            "roll call (29401)",
        ),
    ],
)
def test_node_shapes_that_do_not_fit(tmp_path: Path, overrides: dict, visible: int, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg = config(tmp_path, **overrides)
        cluster = resolve_cluster(cfg)
        plan_node(cfg, cluster, cluster.unit("trainer-0"), [str(i) for i in range(visible)])


def test_submit_time_checks_plan_every_node(tmp_path: Path) -> None:
    """The submitting machine has no GPUs; the nodes are planned against gpus_per_node."""
    check_plans(config(tmp_path, **{"cluster.gpus_per_node": 8, "cluster.hosts": None}))
    with pytest.raises(ConfigError, match="cannot split"):
        check_plans(config(tmp_path, **{"cluster.gpus_per_node": 6, "cluster.servers_per_node": 4}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"cluster.inference_nodes": 0},
            "cluster.trainer_nodes = 2, orchestrator_node = 'inference': several",
        ),
        (
            {"cluster.inference_nodes": 0, "cluster.trainer_nodes": 1, "cluster.servers_per_node": 2},
            "use deployment",
        ),
        (
            {"cluster.inference_nodes": 0, "cluster.trainer_nodes": 1, "cluster.prefill_servers_per_node": 1},
            "cluster.prefill_servers_per_node applies to several nodes",
        ),
        (
            {"cluster.inference_nodes": 0, "cluster.trainer_nodes": 1, "cluster.prefill_nodes": 1},
            "cluster.prefill_nodes applies to several nodes",
        ),
        ({}, "a run on several nodes starts through [slurm], [kubernetes] (--k8s), or one"),
    ],
)
def test_one_machine_plans_refuse_cluster_settings(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_run(config(tmp_path, **overrides), [])


def test_weights_group_on_one_machine(tmp_path: Path) -> None:
    cfg = config(
        tmp_path, **{"cluster.inference_nodes": 0, "cluster.trainer_nodes": 1, "cluster.hosts": None}
    )
    plan = plan_run(cfg, [])
    sections = [plan.trainer, plan.orchestrator, *plan.inference]
    addresses = {(s.weights.host, s.weights.port) for s in sections}
    (address,) = addresses  # every process agrees on one address: loopback, a free port
    assert address[0] == "127.0.0.1" and address[1] > 0


def test_unshared_run_dir_warning(tmp_path: Path) -> None:
    fstype, mount = filesystem_type(tmp_path)
    warning = unshared_run_dir_warning(tmp_path / "run")
    if fstype in ("ext4", "xfs", "overlay", "tmpfs", "btrfs"):
        assert warning == (
            f"run_dir {tmp_path / 'run'} is on a local {fstype} filesystem (mounted at {mount}): every node "
            "must see the same run directory; put it on a shared filesystem (NFS, Lustre, GPFS, ...)"
        )
    assert filesystem_type(Path("/proc/self")) == ("proc", "/proc")
    assert unshared_run_dir_warning(Path("/proc/self")) is None  # not known to be local
