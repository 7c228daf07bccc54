"""The weight link: how trainer ranks and inference servers meet and agree on each in-memory update
(the `broadcast` and `colocated` transports; docs/weights.md).

All coordination goes through one torch.distributed TCPStore that trainer rank 0 hosts at
`host:port`; the tensors themselves travel through a process group (broadcast) or through buffers
a trainer rank shares with the servers on its device (colocated). Keys, at start:

    server/<i>        each server: the transport it asks for, its device, its serving dtype
    trainer/<r>       each trainer rank: its device
    plan              rank 0: every server's route (colocated with rank r, or rank g of the
                      broadcast group), the serving dtype, the size of one bucket buffer
    slots/<r>         rank r, if a server is colocated with it: the handle of its two buffers
    joined/<i>        each server, once it has opened its route (the broadcast group has run one
                      warm-up broadcast, so NCCL's communicator exists before the first update)

and for each update of policy version N:

    offer/N           rank 0: the tensor specs and the bucket size
    ready/N/<i>       server i: "" or why it refuses (names, shapes or dtypes differ from its model)
    go/N              rank 0: "" or why the update is abandoned (a refusal); nothing changed anywhere
    filled/N/<r>/<k>  colocated: rank r packed bucket k into its buffer k % 2
    freed/N/<i>/<k>   colocated: server i copied bucket k out of that buffer
    done/N/<i>        server i: "" once its model holds version N, else the error that stopped it

Rank 0 deletes version N's keys when every server is done. Every wait has a deadline
(`transfer_timeout_s` per update, `connect_timeout_s` at start) and fails with an error that names
the side that waited, the policy version and what did not come.

Imports only torch and the standard library: vLLM's worker extension uses it too.
"""

import json
import re
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.net import is_local_address
from tandem.transport.shared_buffers import gpu_uuid

WARM_UP_ELEMENTS = 1


@dataclass(frozen=True)
class LinkSettings:
    """Where the weight group meets and how long each side waits (from `[weights]`)."""

    host: str
    port: int
    transfer_timeout_s: float
    connect_timeout_s: float
    bucket_bytes: int = 512 << 20

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def of(cls, weights: Any) -> "LinkSettings":
        """From a `[weights]` section (tandem.transport.config.WeightsConfig)."""
        if not weights.port:
            raise LinkError(
                f"weights.port: transport {weights.transport} needs the port of the weight group's store "
                "(the rl launcher picks a free one)"
            )
        return cls(
            weights.host,
            weights.port,
            weights.transfer_timeout_s,
            weights.connect_timeout_s,
            weights.bucket_bytes,
        )


class LinkError(RuntimeError):
    """The trainer and the servers cannot form the weight link (a deployment problem)."""


class TransferError(RuntimeError):
    """An in-memory update did not happen. `partial` is set when some tensors were already copied,
    so the receiving model mixes two versions."""

    partial = False


def collective_failure(error: BaseException) -> str:
    """What a failed broadcast's error says, in one line: its first line without the C++ source
    location that gloo and NCCL put in front ("[.../pair.cc:545] Read error ...") or gloo's advice
    after it."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    line = re.sub(r"^\[[^\]]*:\d+\]\s*", "", line)
    return line.split(" This is typically caused by")[0]


class TransferRefused(TransferError):
    """The offered tensors do not fit the server's model; nothing was copied."""


class TransferTimeout(TransferError):
    """One side waited longer than its deadline for the other."""


@dataclass(frozen=True)
class Route:
    """How one server receives: `colocated` from trainer rank `trainer_rank`'s buffers, or as rank
    `group_rank` of the broadcast group (whose rank 0 is trainer rank 0)."""

    transport: str
    trainer_rank: int = 0
    group_rank: int = 0


def device_id(device: torch.device) -> str:
    """Names the physical device, equal in every process that uses it: a GPU by its UUID, the CPU
    by the host (hostname and boot id, so two containers of one host count as one)."""
    if device.type == "cuda":
        return f"cuda:{gpu_uuid(device)}"
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"cpu:{socket.gethostname()}:{boot.read_text().strip() if boot.is_file() else ''}"


def make_plan(servers: list[dict], trainers: list[dict]) -> dict:
    """Routes for `servers` ({transport, device, dtype} each) given the trainer ranks' devices.

    auto: colocated when a trainer rank runs on the server's device, broadcast otherwise. Servers on
    one device spread over the trainer ranks there. Raises LinkError for a deployment that cannot work.
    """
    dtypes = {s["dtype"] for s in servers}
    if len(dtypes) > 1:
        shown = ", ".join(f"server {i} {s['dtype']}" for i, s in enumerate(servers))
        raise LinkError(f"the servers serve different dtypes ({shown}); give them all one model.dtype")
    routes, group_rank = [], 0
    for i, server in enumerate(servers):
        same = [r for r, t in enumerate(trainers) if t["device"] == server["device"]]
        transport = server["transport"]
        if transport == "auto":
            transport = "colocated" if same else "broadcast"
        if transport == "colocated":
            if not same:
                devices = ", ".join(f"rank {r} on {t['device']}" for r, t in enumerate(trainers))
                raise LinkError(
                    f"server {i} asks for transport colocated but no trainer rank shares its device "
                    f"{server['device']} ({devices}); use broadcast or auto"
                )
            routes.append(Route("colocated", trainer_rank=same[i % len(same)]))
            continue
        if server["device"].startswith("cuda") and 0 in same:
            raise LinkError(
                f"server {i} shares its GPU with trainer rank 0, and NCCL cannot broadcast between two "
                "processes on one GPU; use transport colocated or auto"
            )
        if server["device"].split(":")[0] != trainers[0]["device"].split(":")[0]:
            raise LinkError(
                f"server {i} runs on {server['device']} but trainer rank 0 on {trainers[0]['device']}: a "
                "broadcast group is all GPUs (NCCL) or all CPUs (gloo)"
            )
        group_rank += 1
        routes.append(Route("broadcast", group_rank=group_rank))
    return {
        "routes": [asdict(r) for r in routes],
        "group_size": group_rank + 1 if group_rank else 0,
        "dtype": dtypes.pop(),
    }


class Link:
    """The store seen from one side (`side` names it in errors: "trainer", "server 1")."""

    def __init__(self, settings: LinkSettings, side: str, master: bool) -> None:
        self.settings = settings
        self.side = side
        if master and not is_local_address(settings.host):
            # (a TCPStore listens on every address of its own machine: it would start, and the
            # other side wait connect_timeout_s at an address where nothing listens)
            raise LinkError(
                f"{side}: rank 0 hosts the weight group's store at {settings.address}, but runs on "
                f"{socket.gethostname()}, which does not have the address {settings.host} (weights.host; "
                "several nodes: the host of the trainer node whose host sorts first, where the node "
                "launchers have torchrun put rank 0)"
            )
        try:
            self.store = dist.TCPStore(
                settings.host,
                settings.port,
                None,
                master,
                timedelta(seconds=settings.connect_timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, dist.DistError) as e:
            role = "host" if master else f"reach within {settings.connect_timeout_s:g} s"
            raise LinkError(
                f"{side}: cannot {role} the weight group's store at {settings.address} "
                f"(weights.host/port, weights.connect_timeout_s): {e}"
            ) from None

    def put(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)

    def put_json(self, key: str, value: object) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def get_json(self, key: str) -> object:
        return json.loads(self.store.get(key))

    def wait(self, keys: list[str], deadline: float, problem: Callable[[list[str]], str]) -> None:
        """Until every key exists or `deadline` (time.monotonic()) passes; then a TransferTimeout
        whose message is `problem(missing keys)`, prefixed with this side's name."""
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            self.store.wait(keys, timedelta(seconds=remaining))
        except (RuntimeError, dist.DistError):
            try:
                missing = [k for k in keys if not self.store.check([k])]
            except (RuntimeError, dist.DistError):
                raise TransferError(
                    f"{self.side}: {problem(keys)}: lost the weight group's store at {self.settings.address} "
                    "(trainer rank 0 hosts it: did the trainer exit?)"
                ) from None
            if not missing:
                return
            raise TransferTimeout(f"{self.side}: {problem(missing)}") from None

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self.store.delete_key(key)


def deadline(seconds: float) -> float:
    return time.monotonic() + seconds


def new_group(link: Link, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """The broadcast group over the link's store (trainer rank 0 is rank 0): NCCL for GPU tensors,
    gloo for CPU ones. Runs one warm-up broadcast, so the first update pays no set-up."""
    timeout = timedelta(seconds=link.settings.transfer_timeout_s)
    group = process_group(dist.PrefixStore("group", link.store), rank, size, device, timeout)
    broadcast(group, torch.zeros(WARM_UP_ELEMENTS, device=device)).wait()
    return group


def process_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta
) -> dist.ProcessGroup:
    """A process group of its own over `store` (not torch.distributed's default group): NCCL for
    GPU tensors, gloo for CPU ones."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Asynchronous broadcast from the group's rank 0. On CUDA the caller's stream is ordered before
    it, and `wait()` orders it before the caller's later work (no host sync)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def sync(device: torch.device) -> None:
    """Wait on the host for the work queued on `device`'s current stream (copies into or out of a
    shared buffer must be complete before the other process is told)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def indices(keys: list[str]) -> str:
    """'server/3' and 'ready/5/3' → '3' for error messages: the last path part of each key."""
    return ", ".join(k.rsplit("/", 1)[-1] for k in keys)
