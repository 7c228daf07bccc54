"""Configuration of the `rl` launcher: the three processes' sections plus how to deploy them."""

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.config.base import ModelConfig, Section
from tandem.inference.config import InferenceConfig
from tandem.monitor.config import MonitorConfig
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.transport.config import WeightsConfig


class DeploymentConfig(Section):
    """How many processes run where on one machine. GPU ids are as CUDA_VISIBLE_DEVICES names them.

    With several nodes ([cluster] inference_nodes > 0) only the timeouts and cpu_threads apply.
    """

    inference_servers: int | None = Field(
        None, gt=0, description="Inference servers; default: one per inference GPU (one on CPU)."
    )
    prefill_servers: int = Field(
        0,
        ge=0,
        description="Of the inference servers, how many (the last ones) only compute prompts for the others, "
        "which only decode (docs/inference-engine.md, 'Prefill on other servers'). Needs the prefix cache.",
    )
    inference_ports: list[int] | None = Field(
        None, description="Port of each server; default: inference.port, inference.port + 1, ..."
    )
    trainer_nproc: int | None = Field(
        None,
        gt=0,
        description="Trainer ranks (torchrun when > 1); default: one per trainer GPU (one on CPU).",
    )
    inference_gpus: list[str] | None = Field(
        None,
        description="GPUs of the inference servers; default: none visible → CPU, one → shared with the "
        "trainer, more → the first half.",
    )
    trainer_gpus: list[str] | None = Field(
        None, description="GPUs of the trainer; default: the visible GPUs not used for inference."
    )
    colocated_gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="When a server shares a GPU with the trainer: the server's gpu_memory_utilization "
        "(native engine and vLLM), unless the inference section sets it.",
    )
    cpu_threads: int | None = Field(
        None,
        gt=0,
        description="CPU runs: OMP_NUM_THREADS of each server and trainer rank; default: the cores "
        "split evenly between them (unless OMP_NUM_THREADS is set already).",
    )
    startup_timeout_s: float = Field(
        600, gt=0, description="How long each server may take to answer /health."
    )
    shutdown_grace_s: float = Field(
        10, gt=0, le=30, description="Seconds between SIGTERM and SIGKILL when stopping processes."
    )

    @field_validator("inference_gpus", "trainer_gpus", mode="before")
    @classmethod
    def gpu_names(cls, value: Any) -> Any:
        """Accept `[0, 1]` as well as `["0", "1"]` (or GPU UUIDs)."""
        if isinstance(value, list):
            return [str(v) if isinstance(v, int) else v for v in value]
        return value

    @field_validator("inference_ports")
    @classmethod
    def distinct_ports(cls, ports: list[int] | None) -> list[int] | None:
        if ports is not None and (len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports)):
            raise ValueError(f"ports must be distinct and in 1..65535, got {ports}")
        return ports


class ClusterConfig(Section):
    """Which nodes run what (docs/scaling.md). The launcher derives every address from this and
    the nodes' host names: server URLs, the trainer's rendezvous endpoint, the weights group."""

    inference_nodes: int = Field(
        0,
        ge=0,
        description="Nodes that run only inference servers; 0 = one node runs everything, its devices "
        "split as [deployment] says.",
    )
    servers_per_node: int | None = Field(
        None,
        gt=0,
        description="Inference servers on each inference node; default: one per GPU (one on CPU nodes).",
    )
    prefill_servers_per_node: int = Field(
        0,
        ge=0,
        description="Of each inference node's servers, how many (the last ones) compute prompts for the node's "
        "others, through staging buffers within the node (docs/inference-engine.md, 'Prefill on other servers').",
    )
    prefill_nodes: int = Field(
        0,
        ge=0,
        description="Of the inference nodes, how many (the last ones) run only prefill servers, which compute "
        "the other inference nodes' prompts and send the keys and values over a p2p link per pair of servers "
        "(NCCL; docs/inference-engine.md, 'Prefill on other servers').",
    )
    trainer_nodes: int = Field(1, gt=0, description="Nodes that run the trainer (torchrun, one agent each).")
    trainer_ranks_per_node: int | None = Field(
        None,
        gt=0,
        description="Trainer ranks on each trainer node; default: one per GPU (one on CPU nodes).",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="GPUs of every node (what Slurm and Kubernetes request); default: none requested, "
        "and a node uses the GPUs it sees.",
    )
    orchestrator_node: Literal["inference", "trainer", "own"] = Field(
        "inference",
        description="Where the orchestrator runs: on the first inference node, the first trainer node, or "
        "a node of its own (the last one). On Kubernetes it always has a pod of its own, placed beside "
        "the first inference or trainer pod unless 'own'.",
    )
    hosts: list[str] | None = Field(
        None,
        description="Host name or address of each node: inference nodes first, then trainer nodes (then "
        "the orchestrator's own node). Slurm and Kubernetes fill this in; give it for runs without a "
        "scheduler.",
    )
    rdzv_port: int = Field(
        29400,
        gt=0,
        lt=65535,
        description="The trainer's c10d rendezvous on the first trainer node; the node roll call uses "
        "the port after it.",
    )
    weights_group_port: int = Field(
        29500,
        gt=0,
        lt=65536,
        description="Port of the weight-transfer group's address, on the trainer node that runs rank 0 "
        "(the one whose host sorts first).",
    )
    join_timeout_s: float = Field(
        600, gt=0, description="How long each node waits for every other node to join the roll call."
    )

    @model_validator(mode="after")
    def ports_apart(self) -> "ClusterConfig":
        """The roll call takes rdzv_port + 1 on the first trainer node, which may run rank 0 and the
        weights group too."""
        if self.weights_group_port in (self.rdzv_port, self.rdzv_port + 1):
            raise PydanticCustomError(
                "ports",
                f"cluster.weights_group_port ({self.weights_group_port}) collides with the trainer's "
                f"rendezvous ({self.rdzv_port}) or its node roll call ({self.rdzv_port + 1}) on the first "
                "trainer node",
            )
        return self

    @field_validator("hosts", mode="before")
    @classmethod
    def comma_separated(cls, value: Any) -> Any:
        """Accept `a,b,c` (what the sbatch script passes) as well as a list."""
        if isinstance(value, str):
            return [h.strip() for h in value.split(",") if h.strip()]
        return value


class SlurmConfig(Section):
    """`rl @ cfg.toml` renders an sbatch script from these (and [cluster]) and submits it."""

    partition: str | None = Field(None, description="#SBATCH --partition.")
    account: str | None = Field(None, description="#SBATCH --account.")
    time: str | None = Field(None, description="#SBATCH --time, e.g. '04:00:00'.")
    job_name: str | None = Field(None, description="#SBATCH --job-name; default: tandem-<run_dir's name>.")
    exclusive: bool = Field(True, description="#SBATCH --exclusive: the job has its nodes to itself.")
    sbatch: list[str] = Field(
        [], description="Extra #SBATCH lines, e.g. ['--qos=high', '--mem=0'] (the '#SBATCH ' is added)."
    )
    env: dict[str, str] = Field({}, description="Environment variables exported in the job, on every node.")
    setup: list[str] = Field(
        [], description="Shell lines run before the launcher (module load ..., source venv/bin/activate)."
    )
    python: str | None = Field(
        None, description="Python that runs tandem on the nodes; default: the one running `rl`."
    )
    template: Path | None = Field(
        None, description="Your own Jinja2 sbatch template (it may extend the packaged ones)."
    )


class KubernetesConfig(Section):
    """`rl @ cfg.toml --k8s` (or this section) renders manifests into `output_dir`."""

    image: str = Field("tandem:latest", description="Container image with tandem installed.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the nodes pull the image."
    )
    namespace: str = Field("default", description="Namespace of every resource.")
    name: str | None = Field(
        None, description="Prefix of every resource's name; default: tandem-<run_dir's name>."
    )
    output_dir: Path | None = Field(None, description="Where the manifests go; default: run_dir/kubernetes.")
    mount_path: str = Field(
        "/data", description="Where the shared volume is mounted in every pod; run_dir lives on it."
    )
    volume_claim: str | None = Field(
        None, description="An existing ReadWriteMany claim to use; default: the manifests create one."
    )
    storage_size: str = Field("100Gi", description="Size of the created claim.")
    storage_class: str | None = Field(
        None, description="Storage class of the created claim (must offer RWX)."
    )
    gpu_resource: str = Field("nvidia.com/gpu", description="Resource name of a GPU in the cluster.")
    cpu: str | None = Field(None, description="CPU request and limit of every pod, e.g. '32'.")
    memory: str | None = Field(None, description="Memory request and limit of every pod, e.g. '256Gi'.")
    shm_size: str = Field("16Gi", description="Size of the in-memory /dev/shm (NCCL, dataloaders).")
    env: dict[str, str] = Field({}, description="Environment variables of every container.")
    node_selector: dict[str, str] = Field({}, description="nodeSelector of every pod.")


class RLConfig(Section):
    """One RL run: inference server(s), orchestrator and trainer, on one machine or several nodes.

    The top-level fields are written once and flow into every section that leaves them unset;
    the launcher itself fills in what connects the processes (server URLs, ranks, run_dir, resume).
    """

    model: ModelConfig = Field(ModelConfig(), description="The policy's initial checkpoint (all processes).")
    seq_len: int = Field(
        2048, gt=0, description="Most tokens of one sample; also the servers' context length."
    )
    max_steps: int = Field(
        20, gt=0, description="Trainer steps; the orchestrator produces rollouts for each."
    )
    run_dir: Path = Field(Path("runs/rl"), description="Run directory shared by all processes.")
    seed: int = Field(0, description="Seed of every process (task order, sampling, initialisation).")
    resume: bool = Field(False, description="Continue the run in run_dir (orchestrator and trainer).")
    deployment: DeploymentConfig = DeploymentConfig()
    cluster: ClusterConfig = ClusterConfig()
    slurm: SlurmConfig | None = Field(
        None, description="Run through Slurm: `rl` renders an sbatch script and submits it."
    )
    kubernetes: KubernetesConfig | None = Field(
        None, description="Run on Kubernetes: `rl` renders manifests to apply with kubectl."
    )
    weights: WeightsConfig = Field(
        WeightsConfig(transport="auto"),
        description="How weights travel from the trainer to the servers; written once for all processes "
        "(a process's own [<process>.weights] may add to it). The launcher sets host, port (a free one "
        "unless given), num_servers and server_index.",
    )
    monitor: MonitorConfig = Field(
        MonitorConfig(),
        description="W&B ([monitor.wandb]): one run with every process's metrics, written by the orchestrator.",
    )
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: RLTrainerConfig = RLTrainerConfig()

    @classmethod
    def effective_defaults(cls) -> "RLConfig":
        """The defaults `--help` and the config reference show (tandem.config.fields): the
        per-process sections as the launcher fills them in, not each section's own defaults
        (orchestrator.max_steps is the top-level max_steps, not the orchestrator's 100)."""
        from tandem.launch.sections import effective_defaults  # (sections imports this module)

        return effective_defaults(cls())
