"""The `[weights]` section: how policy weights travel from the trainer to the inference servers.

One class for every process of a run (trainer, orchestrator, servers) and for the `rl` launcher's
top level, which writes it once; each process reads the fields it needs (docs/weights.md). The
launcher fills in the fields that connect the processes (`host`, `port`, `num_servers`,
`server_index`). Imports no torch.
"""

from typing import Literal

from pydantic import Field

from tandem.config.base import Section

Transport = Literal["auto", "filesystem", "broadcast", "colocated"]


class WeightsConfig(Section):
    """How new policy weights reach the servers (docs/weights.md)."""

    transport: Transport = Field(
        "filesystem",
        description="filesystem: weights/step_N on disk every step; broadcast: one torch.distributed group "
        "of trainer rank 0 and every server (NCCL on GPU, gloo on CPU); colocated: a server on a trainer "
        "rank's device copies from that rank's buffer (CUDA IPC, shared memory on CPU); auto: colocated "
        "for a server that shares a trainer rank's device, broadcast otherwise. The rl launcher defaults "
        "to auto; a process started on its own to filesystem.",
    )
    export_interval: int = Field(
        0,
        ge=0,
        description="With broadcast/colocated: also write weights/step_N as a Hugging Face model every N "
        "steps and after the last; 0 = only after the last. (filesystem writes every step.)",
    )
    keep: int = Field(
        3,
        ge=0,
        description="Keep the newest N weights/step_N directories; 0 = keep all. With filesystem it must "
        "exceed the orchestrator's max_async_level so no server is ever sent a deleted version.",
    )
    transfer_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest one in-memory transfer may take, each side waiting for the other included; "
        "then the side that waited fails, naming the step.",
    )
    connect_timeout_s: float = Field(
        900.0, gt=0, description="How long the trainer and the servers wait for each other to join at start."
    )
    bucket_mb: int = Field(
        512, gt=0, description="Size of one transfer bucket in MiB (tensors larger than that get their own)."
    )
    poll_interval: float = Field(
        0.01, gt=0, description="Orchestrator: seconds between looks for a new policy version."
    )
    wait_timeout: float = Field(
        3600.0, gt=0, description="Orchestrator: seconds to wait for weights that max_async_level requires."
    )
    host: str = Field(
        "127.0.0.1", description="Address of trainer rank 0, where the weight group meets (set by rl)."
    )
    port: int = Field(
        0, ge=0, le=65535, description="Port of the weight group's store on `host`; set by rl (a free one)."
    )
    num_servers: int = Field(1, gt=0, description="Trainer: inference servers that join (set by rl).")
    server_index: int = Field(0, ge=0, description="Server: its index among the servers (set by rl).")

    @property
    def in_memory(self) -> bool:
        return self.transport != "filesystem"

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20
