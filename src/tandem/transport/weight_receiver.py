"""Server side of the in-memory transports: join the weight link at start, receive each version.

`WeightReceiver.start()` joins in a background thread when the server starts (the trainer comes
up later). An update is two steps, so that a refusal changes nothing:

    transfer = receiver.begin(version, expected, optional)   # the handshake; raises TransferRefused
    for name, tensor in transfer:                             # views of the bucket just received
        model_tensor[name].copy_(tensor)

`begin` checks the offered names, shapes and dtypes against the model's before anything moves.
A server that takes more than one kind of update (full weights, or a LoRA adapter: the offer's
`meta` says which) splits the handshake: `offer = receiver.offer(version)`, its own check of
`offer.specs` and `offer.meta`, then `receiver.accept(offer, problem)`.
Iterating receives bucket by bucket (broadcast: into two local buffers, the next bucket's receive
posted while the previous one is copied; colocated: straight out of the trainer's shared buffers)
and reports `done` to the trainer after the last tensor was copied. A tensor is valid until the
consumer asks for the next one.

Imports only torch and the standard library: vLLM's worker extension uses it too.
"""

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from tandem.transport.shared_buffers import OpenedBuffers
from tandem.transport.weight_buckets import Bucket, TensorSpec, bucket_layout, slot_bytes, spec_mismatch
from tandem.transport.weight_link import (
    Link,
    LinkError,
    LinkSettings,
    Route,
    TransferError,
    TransferRefused,
    TransferTimeout,
    broadcast,
    collective_failure,
    deadline,
    device_id,
    new_group,
    sync,
)

SLOTS = 2


class WeightReceiver:
    def __init__(
        self,
        settings: LinkSettings,
        server_index: int,
        transport: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.settings = settings
        self.index = server_index
        self.transport = transport
        self.device = device
        self.dtype = dtype
        self.side = f"server {server_index}"
        self.link: Link | None = None
        self.route: Route | None = None
        self.group = None
        self.buffers: OpenedBuffers | None = None
        self.local: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- start ------------------------------------------------------------------------------

    def start(self) -> None:
        """Join the weight link in a background thread (it waits for the trainer)."""
        self._thread = threading.Thread(
            target=self._connect_reporting, name="tandem-weight-link", daemon=True
        )
        self._thread.start()

    def _connect_reporting(self) -> None:
        try:
            self.connect()
        except BaseException as e:  # noqa: BLE001 — reported by wait_connected
            self._error = e

    def connect(self) -> None:
        s = self.settings
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # this thread's device, for NCCL
        self.link = link = Link(s, self.side, master=False)
        info = {"transport": self.transport, "device": device_id(self.device), "dtype": _name(self.dtype)}
        link.put_json(f"server/{self.index}", info)
        until = deadline(s.connect_timeout_s)
        link.wait(["plan"], until, lambda _: f"the trainer did not publish the weight plan at {s.address}")
        plan = link.get_json("plan")
        if "error" in plan:
            raise LinkError(plan["error"])
        self.route = route = Route(**plan["routes"][self.index])
        if route.transport == "colocated":
            key = f"slots/{route.trainer_rank}"
            link.wait([key], until, lambda _: f"trainer rank {route.trainer_rank} did not share its buffers")
            self.buffers = OpenedBuffers(link.get(key))
        else:
            self.group = new_group(link, route.group_rank, plan["group_size"], self.device)
        link.put(f"joined/{self.index}", "")

    @property
    def connected(self) -> bool:
        return self.route is not None and self.link is not None and self._error is None

    def wait_connected(self, timeout_s: float) -> None:
        """Raise why the link is not up after `timeout_s` (its connect error, or a TransferTimeout)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._error is not None:
            raise LinkError(f"{self.side}: no weight link: {self._error}")
        if not self.connected:
            raise TransferTimeout(
                f"{self.side}: not linked to the trainer yet (waiting for it at {self.settings.address})"
            )

    def describe(self) -> str:
        if self.route is None:
            return "not linked"
        if self.route.transport == "colocated":
            return f"colocated with trainer rank {self.route.trainer_rank}"
        return f"broadcast group rank {self.route.group_rank}"

    # ---- one update -------------------------------------------------------------------------

    def begin(
        self, version: int, expected: Mapping[str, TensorSpec], optional: frozenset[str] = frozenset()
    ) -> "Transfer":
        """The handshake of policy `version`: check the offer against `expected` (the model's tensors
        by name) and wait until every server agreed. Raises TransferRefused (nothing changes) or
        TransferTimeout."""
        offer = self.offer(version)
        return self.accept(offer, spec_mismatch(offer.specs, expected, optional))

    def offer(self, version: int) -> "Offer":
        """Wait for the trainer's offer of policy `version` (raises TransferTimeout)."""
        self.wait_connected(self.settings.transfer_timeout_s)
        link = self.link
        assert link is not None
        t = self.settings.transfer_timeout_s
        until = deadline(t)
        link.wait(
            [f"offer/{version}"],
            until,
            lambda _: (
                f"policy version {version}: the trainer offered nothing within {t:g} s (weights.transfer_timeout_s)"
            ),
        )
        offer = link.get_json(f"offer/{version}")
        specs = [TensorSpec.from_json(item) for item in offer["specs"]]
        return Offer(version, specs, offer.get("meta") or {}, offer["bucket_bytes"], until)

    def accept(self, offer: "Offer", problem: str | None) -> "Transfer":
        """Answer `offer`: refuse it with `problem` (raises TransferRefused; nothing changes), or take
        it once every server agreed."""
        link = self.link
        assert link is not None
        version, what = offer.version, f"policy version {offer.version}"
        link.put(f"ready/{version}/{self.index}", problem or "")
        if problem:
            raise TransferRefused(f"{self.side}: {what} does not fit this server's model: {problem}")
        link.wait(
            [f"go/{version}"],
            offer.until,
            lambda _: (
                f"{what}: the trainer did not start the transfer within {self.settings.transfer_timeout_s:g} s"
            ),
        )
        if refusal := link.get(f"go/{version}").decode():
            raise TransferRefused(f"{self.side}: the trainer abandoned {what}: {refusal}")
        return Transfer(
            self, version, bucket_layout(offer.specs, offer.bucket_bytes), offer.until, offer.meta
        )

    def local_slots(self, nbytes: int) -> list[torch.Tensor]:
        if not self.local or self.local[0].numel() < nbytes:
            self.local = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)]
        return self.local

    def close(self) -> None:
        if self.buffers is not None:
            self.buffers.close()


@dataclass(frozen=True)
class Offer:
    """What the trainer offers for one policy version: the tensors' specs, and `meta` (the
    adapter_config of a LoRA adapter; empty for full weights)."""

    version: int
    specs: list[TensorSpec]
    meta: dict
    bucket_bytes: int
    until: float


class Transfer:
    """The tensors of one accepted update, as they arrive."""

    def __init__(
        self, receiver: WeightReceiver, version: int, layout: list[Bucket], until: float, meta: dict
    ) -> None:
        self.receiver = receiver
        self.version = version
        self.layout = layout
        self.until = until
        self.meta = meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        receiver = self.receiver
        link = receiver.link
        assert link is not None and receiver.route is not None
        done = f"done/{self.version}/{receiver.index}"
        try:
            if receiver.route.transport == "colocated":
                yield from self._colocated()
            else:
                yield from self._broadcast()
            sync(receiver.device)
        except Exception as e:
            link.put(done, f"{type(e).__name__}: {e}")
            raise
        link.put(done, "")

    def _broadcast(self) -> Iterator[tuple[str, torch.Tensor]]:
        receiver, layout = self.receiver, self.layout
        slots = receiver.local_slots(slot_bytes(layout))

        def post(k: int):
            return broadcast(receiver.group, slots[k % SLOTS][: layout[k].nbytes])

        pending = [post(k) for k in range(min(SLOTS, len(layout)))]
        for k, bucket in enumerate(layout):
            try:
                pending[k % SLOTS].wait()
            except RuntimeError as e:
                raise TransferError(
                    f"{receiver.side}: policy version {self.version}: bucket {k + 1} of {len(layout)} did not arrive: {collective_failure(e)}"
                ) from None
            yield from bucket.views(slots[k % SLOTS])
            if k + SLOTS < len(layout):
                pending[k % SLOTS] = post(k + SLOTS)

    def _colocated(self) -> Iterator[tuple[str, torch.Tensor]]:
        receiver, link = self.receiver, self.receiver.link
        assert receiver.buffers is not None and receiver.route is not None and link is not None
        rank = receiver.route.trainer_rank
        for k, bucket in enumerate(self.layout):
            link.wait(
                [f"filled/{self.version}/{rank}/{k}"],
                self.until,
                lambda _, k=k: (
                    f"policy version {self.version}: trainer rank {rank} did not fill bucket {k + 1} of {len(self.layout)} in time"
                ),
            )
            yield from bucket.views(receiver.buffers.tensors[k % SLOTS])
            sync(receiver.device)
            link.put(f"freed/{self.version}/{receiver.index}/{k}", "")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
