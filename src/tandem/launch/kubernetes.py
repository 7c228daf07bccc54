"""`rl @ cfg.toml --k8s` (or a [kubernetes] section): manifests for the run, to apply with
`kubectl apply -f DIR`. Nothing is sent to a cluster from here.

Rendered from the same deployment model as Slurm (tandem.launch.cluster), one unit per pod:
- 00-config.yaml: a ConfigMap with the config every pod's node launcher reads (cluster.hosts
  filled in with the pods' stable DNS names, run_dir on the shared volume);
- 01-volume.yaml: a ReadWriteMany PersistentVolumeClaim for the run directory (unless
  `kubernetes.volume_claim` names an existing one), mounted at `mount_path` in every pod;
- 10-inference.yaml, 11-trainer.yaml: a headless Service and a StatefulSet each, one pod per
  node, `gpus_per_node` GPUs per pod; pod k of a StatefulSet is unit inference-k / trainer-k;
- 12-orchestrator.yaml: a Job whose one pod runs the orchestrator, placed on the machine of the
  first inference (or trainer) pod per `cluster.orchestrator_node`, or anywhere for 'own'.

A StatefulSet restarts a container that exits, even after success, so the inference and trainer
pods' launchers `--hold` after a successful run; the orchestrator Job's completion is the run's.
"""

import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from tandem.config.loader import ConfigError
from tandem.launch.cluster import is_multi_node, servers_per_node
from tandem.launch.config import KubernetesConfig, RLConfig
from tandem.launch.jobs import check_plans, node_config_text

CONFIG_DIR = "/etc/tandem"
NODE_COMMAND = ["python", "-m", "tandem.launch.node", "@", f"{CONFIG_DIR}/rl.toml"]
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
FILES = ("00-config.yaml", "01-volume.yaml", "10-inference.yaml", "11-trainer.yaml", "12-orchestrator.yaml")


def write_manifests(config: RLConfig, k8s: KubernetesConfig, say: Callable[[str], None]) -> Path:
    """Render the manifests into k8s.output_dir (default run_dir/kubernetes); that directory."""
    manifests = render(config, k8s)
    out = k8s.output_dir or config.run_dir / "kubernetes"
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (out / name).unlink(missing_ok=True)
    for name, docs in manifests.items():
        (out / name).write_text(yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False))
    say(f"wrote {len(manifests)} manifest files to {out}; start the run with: kubectl apply -f {out}")
    return out


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people to read: no anchors, multi-line strings (the config) as blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def render(config: RLConfig, k8s: KubernetesConfig) -> dict[str, list[dict[str, Any]]]:
    """File name → its resources, for the run `config` describes."""
    if not is_multi_node(config):
        raise ConfigError(
            "kubernetes: inference and trainer run in pods of their own; set cluster.inference_nodes "
            "(and cluster.trainer_nodes) to the number of pods of each"
        )
    check_plans(config)
    name = resource_name(config, k8s)
    pods_config = pod_config(config, k8s, name)
    claim = k8s.volume_claim or f"{name}-run"
    files: dict[str, list[dict[str, Any]]] = {
        "00-config.yaml": [_config_map(name, k8s, pods_config)],
    }
    if k8s.volume_claim is None:
        files["01-volume.yaml"] = [_volume_claim(claim, name, k8s)]
    cluster = config.cluster
    inference_ports = [config.inference.port + j for j in range(servers_per_node(config))]
    trainer_ports = [cluster.rdzv_port, cluster.rdzv_port + 1, cluster.weights_group_port]
    for file, role, replicas, ports in (
        ("10-inference.yaml", "inference", cluster.inference_nodes, inference_ports),
        ("11-trainer.yaml", "trainer", cluster.trainer_nodes, trainer_ports),
    ):
        pod = _pod_spec(name, k8s, claim, role, cluster.gpus_per_node, ports, hold=True)
        files[file] = [
            _headless_service(name, k8s, role, ports),
            _stateful_set(name, k8s, role, replicas, pod),
        ]
    orchestrator = _pod_spec(name, k8s, claim, "orchestrator", None, [], hold=False)
    if cluster.orchestrator_node != "own":
        orchestrator["affinity"] = _beside(f"{name}-{cluster.orchestrator_node}-0")
    files["12-orchestrator.yaml"] = [_job(name, k8s, orchestrator)]
    return files


def resource_name(config: RLConfig, k8s: KubernetesConfig) -> str:
    name = k8s.name or "tandem-" + re.sub(r"[^a-z0-9-]+", "-", config.run_dir.name.lower()).strip("-")
    # <name>-inference-<index> must stay a DNS label (63 characters) with room for the index
    if not re.fullmatch(r"[a-z]([a-z0-9-]*[a-z0-9])?", name) or len(name) > 40:
        raise ConfigError(
            f"kubernetes.name {name!r}: use lowercase letters, digits and '-', starting with a letter, "
            "at most 40 characters"
        )
    return name


def pod_run_dir(config: RLConfig, k8s: KubernetesConfig) -> PurePosixPath:
    """run_dir inside the pods: on the shared volume (a relative run_dir is placed under it)."""
    mount = PurePosixPath(k8s.mount_path)
    run_dir = PurePosixPath(config.run_dir.as_posix())
    if not run_dir.is_absolute():
        return mount / run_dir
    if run_dir != mount and mount not in run_dir.parents:
        raise ConfigError(
            f"run_dir {run_dir} is not on the shared volume mounted at kubernetes.mount_path = {mount}; "
            "every pod must see the run directory: give a relative run_dir or one under the mount path"
        )
    return run_dir


def pod_hosts(config: RLConfig, k8s: KubernetesConfig, name: str) -> list[str]:
    """The pods' stable DNS names (StatefulSet pod . headless Service . namespace), node order."""
    cluster = config.cluster
    hosts = [
        f"{name}-{role}-{i}.{name}-{role}.{k8s.namespace}.svc"
        for role, count in (("inference", cluster.inference_nodes), ("trainer", cluster.trainer_nodes))
        for i in range(count)
    ]
    return hosts + [f"{name}-orchestrator"]  # a name for messages: nothing connects to it


def pod_config(config: RLConfig, k8s: KubernetesConfig, name: str) -> str:
    return node_config_text(
        config,
        **{
            "run_dir": pod_run_dir(config, k8s).as_posix(),
            "cluster.hosts": pod_hosts(config, k8s, name),
            "cluster.orchestrator_node": "own",  # a pod of its own; placed by affinity
            "kubernetes": None,
            "slurm": None,
        },
    )


def _meta(resource: str, name: str, k8s: KubernetesConfig, role: str | None = None) -> dict[str, Any]:
    return {"name": resource, "namespace": k8s.namespace, "labels": _labels(name, role)}


def _labels(instance: str, role: str | None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": instance}
    return labels | ({"app.kubernetes.io/component": role} if role else {})


def _config_map(name: str, k8s: KubernetesConfig, text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{name}-config", name, k8s),
        "data": {"rl.toml": text},
    }


def _volume_claim(claim: str, name: str, k8s: KubernetesConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": k8s.storage_size}},
    }
    if k8s.storage_class:
        spec["storageClassName"] = k8s.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(claim, name, k8s),
        "spec": spec,
    }


def _pod_spec(
    name: str, k8s: KubernetesConfig, claim: str, role: str, gpus: int | None, ports: list[int], hold: bool
) -> dict[str, Any]:
    node = "orchestrator" if role == "orchestrator" else f"{role}-$(POD_INDEX)"
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if role != "orchestrator":
        label = f"metadata.labels['{POD_INDEX_LABEL}']"
        env.insert(0, {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": label}}})
    env += [{"name": key, "value": value} for key, value in k8s.env.items()]
    limits: dict[str, Any] = {}
    if gpus:
        limits[k8s.gpu_resource] = gpus
    if k8s.cpu:
        limits["cpu"] = k8s.cpu
    if k8s.memory:
        limits["memory"] = k8s.memory
    container: dict[str, Any] = {
        "name": role,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": [*NODE_COMMAND, "--node", node, *(["--hold"] if hold else [])],
        "env": env,
        "ports": [{"containerPort": p} for p in ports],
        "resources": {"limits": limits, "requests": dict(limits)},
        "volumeMounts": [
            {"name": "run", "mountPath": k8s.mount_path},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if role == "inference":
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": ports[0]}, "periodSeconds": 10}
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "run", "persistentVolumeClaim": {"claimName": claim}},
            {"name": "config", "configMap": {"name": f"{name}-config"}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}},
        ],
    }
    if k8s.node_selector:
        pod["nodeSelector"] = dict(k8s.node_selector)
    return pod


def _headless_service(name: str, k8s: KubernetesConfig, role: str, ports: list[int]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(f"{name}-{role}", name, k8s, role),
        "spec": {
            "clusterIP": "None",  # headless: one DNS record per pod
            "publishNotReadyAddresses": True,  # the roll call and rendezvous run before readiness
            "selector": _labels(name, role),
            "ports": [{"name": f"port-{p}", "port": p, "targetPort": p} for p in ports],
        },
    }


def _stateful_set(
    name: str, k8s: KubernetesConfig, role: str, replicas: int, pod: dict[str, Any]
) -> dict[str, Any]:
    labels = _labels(name, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(f"{name}-{role}", name, k8s, role),
        "spec": {
            "serviceName": f"{name}-{role}",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",  # all nodes start together, as the roll call expects
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def _job(name: str, k8s: KubernetesConfig, pod: dict[str, Any]) -> dict[str, Any]:
    labels = _labels(name, "orchestrator")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(f"{name}-orchestrator", name, k8s, "orchestrator"),
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": labels}, "spec": pod | {"restartPolicy": "Never"}},
        },
    }


def _beside(pod_name: str) -> dict[str, Any]:
    """Affinity that puts a pod on the same machine as the StatefulSet pod `pod_name`."""
    term = {
        "labelSelector": {"matchLabels": {"statefulset.kubernetes.io/pod-name": pod_name}},
        "topologyKey": "kubernetes.io/hostname",
    }
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
