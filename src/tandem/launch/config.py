"""Configuration of the `rl` launcher: the three processes' sections plus how to deploy them."""

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from tandem.config.base import ModelConfig, Section
from tandem.inference.config import InferenceConfig
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.transport.config import WeightsConfig


class DeploymentConfig(Section):
    """How many processes run where. GPU ids are as CUDA_VISIBLE_DEVICES names them."""

    inference_servers: int | None = Field(
        None, gt=0, description="Inference servers; default: one per inference GPU (one on CPU)."
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


class RLConfig(Section):
    """One RL run on one machine: inference server(s), orchestrator and trainer.

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
    weights: WeightsConfig = Field(
        WeightsConfig(transport="auto"),
        description="How weights travel from the trainer to the servers; written once for all processes "
        "(a process's own [<process>.weights] may add to it). The launcher sets host, port (a free one "
        "unless given), num_servers and server_index.",
    )
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: RLTrainerConfig = RLTrainerConfig()
