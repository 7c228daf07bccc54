"""`rl @ cfg.toml --k8s`: manifests valid against the official Kubernetes schemas
(kubernetes-validate, offline), wired to one another, and the pods' config plans every unit."""

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from tandem.config.loader import build_config
from tandem.launch.cli import main
from tandem.launch.cluster import resolve_cluster
from tandem.launch.config import RLConfig
from tandem.launch.plan import plan_node

CONFIG = """
seq_len = 256
max_steps = 3
run_dir = "runs/rt"
[model]
name = "Qwen/Qwen3-0.6B"
[cluster]
inference_nodes = 2
trainer_nodes = 2
gpus_per_node = 8
servers_per_node = 4
orchestrator_node = "trainer"
"""


def render(tmp_path: Path, text: str, *args: str) -> dict[str, list[dict]]:
    (tmp_path / "rl.toml").write_text(text)
    out = tmp_path / "manifests"
    main(["@", str(tmp_path / "rl.toml"), "--kubernetes.output-dir", str(out), *args])
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(out.glob("*.yaml"))}


def by_kind(files: dict[str, list[dict]]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for docs in files.values() for d in docs}


def test_manifests_validate_against_the_kubernetes_schemas(tmp_path: Path) -> None:
    extra = '[kubernetes]\nimage = "registry.example/tandem:1"\nenv = { HF_HOME = "/data/hf" }\ncpu = "32"\n'
    files = render(tmp_path, CONFIG + extra)
    assert list(files) == [
        "00-config.yaml",
        "01-volume.yaml",
        "10-inference.yaml",
        "11-trainer.yaml",
        "12-orchestrator.yaml",
    ]
    for docs in files.values():
        for doc in docs:
            kubernetes_validate.validate(doc, latest_version(), strict=True)  # raises when invalid

    resources = by_kind(files)
    broken = resources["StatefulSet", "tandem-rt-trainer"] | {"spec": {"replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):  # the check is live
        kubernetes_validate.validate(broken, latest_version(), strict=True)
    assert sorted(resources) == [
        ("ConfigMap", "tandem-rt-config"),
        ("Job", "tandem-rt-orchestrator"),
        ("PersistentVolumeClaim", "tandem-rt-run"),
        ("Service", "tandem-rt-inference"),
        ("Service", "tandem-rt-trainer"),
        ("StatefulSet", "tandem-rt-inference"),
        ("StatefulSet", "tandem-rt-trainer"),
    ]
    assert resources["PersistentVolumeClaim", "tandem-rt-run"]["spec"]["accessModes"] == ["ReadWriteMany"]
    trainer = resources["StatefulSet", "tandem-rt-trainer"]
    assert trainer["spec"]["replicas"] == 2 and trainer["spec"]["serviceName"] == "tandem-rt-trainer"
    service = resources["Service", "tandem-rt-trainer"]["spec"]
    assert (
        service["clusterIP"] == "None" and service["selector"] == trainer["spec"]["selector"]["matchLabels"]
    )
    pod = trainer["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][-3:] == ["--node", "trainer-$(POD_INDEX)", "--hold"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "32"}
    assert {"name": "HF_HOME", "value": "/data/hf"} in container["env"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"run": "/data", "config": "/etc/tandem", "shm": "/dev/shm"}
    assert {v["name"]: v for v in pod["volumes"]}["run"]["persistentVolumeClaim"][
        "claimName"
    ] == "tandem-rt-run"
    inference = resources["StatefulSet", "tandem-rt-inference"]["spec"]["template"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in inference["ports"]] == [8000, 8001, 8002, 8003]
    orchestrator = resources["Job", "tandem-rt-orchestrator"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in orchestrator["containers"][0]["resources"]["limits"]
    (term,) = orchestrator["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == {
        "statefulset.kubernetes.io/pod-name": "tandem-rt-trainer-0"
    }


def test_the_pods_config_plans_every_unit(tmp_path: Path) -> None:
    files = render(tmp_path, CONFIG, "--k8s")
    text = by_kind(files)["ConfigMap", "tandem-rt-config"]["data"]["rl.toml"]
    (tmp_path / "pods.toml").write_text(text)
    config = build_config(RLConfig, files=[tmp_path / "pods.toml"])
    assert str(config.run_dir) == "/data/runs/rt" and config.kubernetes is None
    cluster = resolve_cluster(config)
    assert [u.name for u in cluster.units()] == [
        "inference-0",
        "inference-1",
        "trainer-0",
        "trainer-1",
        "orchestrator",
    ]
    gpus = [str(i) for i in range(8)]
    orchestrator = plan_node(config, cluster, cluster.unit("orchestrator"), [])
    assert [s.name for s in orchestrator.specs()] == ["orchestrator"]
    assert (
        orchestrator.orchestrator.servers[4]
        == "http://tandem-rt-inference-1.tandem-rt-inference.default.svc:8000"
    )
    assert orchestrator.orchestrator.num_ranks == 16
    trainer = plan_node(config, cluster, cluster.unit("trainer-1"), gpus)
    assert (
        "--rdzv-endpoint=tandem-rt-trainer-0.tandem-rt-trainer.default.svc:29400" in trainer.specs()[0].argv
    )
    assert [s.name for s in plan_node(config, cluster, cluster.unit("inference-0"), gpus).specs()] == [
        f"inference_{j}" for j in range(4)
    ]


def test_existing_claim_and_no_affinity(tmp_path: Path) -> None:
    text = CONFIG.replace('"trainer"', '"own"') + '[kubernetes]\nvolume_claim = "shared"\nnamespace = "rl"\n'
    files = render(tmp_path, text)
    assert "01-volume.yaml" not in files
    resources = by_kind(files)
    job = resources["Job", "tandem-rt-orchestrator"]
    assert job["metadata"]["namespace"] == "rl" and "affinity" not in job["spec"]["template"]["spec"]
    volumes = resources["StatefulSet", "tandem-rt-trainer"]["spec"]["template"]["spec"]["volumes"]
    assert volumes[0] == {"name": "run", "persistentVolumeClaim": {"claimName": "shared"}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            CONFIG.replace('"runs/rt"', '"/scratch/rt"'),
            "run_dir /scratch/rt is not on the shared volume mounted",
        ),
        (
            CONFIG.replace("inference_nodes = 2", "inference_nodes = 0"),
            "inference and trainer run in pods of",
        ),
        (CONFIG + '[kubernetes]\nname = "Bad_Name"\n', "kubernetes.name 'Bad_Name': use lowercase letters"),
    ],
)
def test_bad_input(tmp_path: Path, capsys, text: str, message: str) -> None:
    with pytest.raises(SystemExit):
        render(tmp_path, text, "--k8s")
    assert re.search(re.escape(message), capsys.readouterr().err)
