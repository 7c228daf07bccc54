"""Trainer side of the in-memory transports: stream one policy version to every server.

Every trainer rank holds a `WeightSender` and calls `send` with the same tensors (the full tensors
of `tandem.trainer.weight_stream.iter_hf_weights`, formed one layer at a time by a collective, so
every rank must iterate to the end). Rank 0 packs them into buckets and broadcasts each to the
servers of the broadcast group; a rank with colocated servers packs into the two buffers it shares
with them and tells them when each is full. Two buffers alternate, so packing bucket k+1 overlaps
sending bucket k. Nothing larger than one bucket is ever held beyond the model itself.
"""

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from tandem.transport.shared_buffers import SharedBuffers
from tandem.transport.weight_buckets import Bucket, TensorSpec, bucket_layout, slot_bytes
from tandem.transport.weight_link import (
    Link,
    LinkError,
    LinkSettings,
    Route,
    TransferError,
    TransferRefused,
    broadcast,
    collective_failure,
    deadline,
    device_id,
    indices,
    make_plan,
    new_group,
    sync,
)

SLOTS = 2


class WeightSender:
    def __init__(
        self, settings: LinkSettings, num_servers: int, rank: int, world_size: int, device: torch.device
    ) -> None:
        self.settings = settings
        self.num_servers = num_servers
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.side = "trainer" if world_size == 1 else f"trainer rank {rank}"
        self.link: Link | None = None
        self.group = None
        self.shared: SharedBuffers | None = None
        self.local: list[torch.Tensor] = []
        self.routes: list[Route] = []
        self.consumers: list[int] = []  # servers colocated with this rank
        self.dtype = torch.float32

    # ---- start ------------------------------------------------------------------------------

    def connect(self, specs_for: Callable[[torch.dtype], list[TensorSpec]]) -> torch.dtype:
        """Meet every server (collective over the trainer's ranks); returns the serving dtype.

        `specs_for(dtype)` gives the tensors an update will carry; it sizes the shared buffers."""
        self.link = link = Link(self.settings, self.side, master=self.rank == 0)
        link.put_json(f"trainer/{self.rank}", {"device": device_id(self.device)})
        until = deadline(self.settings.connect_timeout_s)
        if self.rank == 0:
            plan = self._plan(specs_for, until)
        else:
            link.wait(["plan"], until, lambda _: "trainer rank 0 did not publish the weight plan")
            plan = link.get_json("plan")
            if "error" in plan:
                raise LinkError(plan["error"])
        self.dtype = getattr(torch, plan["dtype"])
        self.routes = [Route(**r) for r in plan["routes"]]
        self.consumers = [
            i for i, r in enumerate(self.routes) if r.transport == "colocated" and r.trainer_rank == self.rank
        ]
        if self.consumers:
            self.shared = SharedBuffers(SLOTS, plan["slot_bytes"], self.device)
            link.put(f"slots/{self.rank}", self.shared.handle)
        if self.rank == 0:
            if plan["group_size"]:
                self.group = new_group(link, 0, plan["group_size"], self.device)
            joined = [f"joined/{i}" for i in range(self.num_servers)]
            link.wait(joined, until, lambda m: f"server(s) {indices(m)} did not open their weight route")
        return self.dtype

    def _plan(self, specs_for: Callable[[torch.dtype], list[TensorSpec]], until: float) -> dict:
        """Rank 0: wait for every server and rank, route them, size the buffers; publish the plan."""
        link, s = self.link, self.settings
        assert link is not None
        servers = [f"server/{i}" for i in range(self.num_servers)]
        late = f"within {s.connect_timeout_s:g} s (weights.connect_timeout_s)"
        link.wait(
            servers,
            until,
            lambda m: f"server(s) {indices(m)} did not join the weight group at {s.address} {late}",
        )
        ranks = [f"trainer/{r}" for r in range(self.world_size)]
        link.wait(
            ranks, until, lambda m: f"trainer rank(s) {indices(m)} did not join the weight group {late}"
        )
        try:
            plan = make_plan([link.get_json(k) for k in servers], [link.get_json(k) for k in ranks])
        except LinkError as e:
            link.put_json("plan", {"error": str(e)})
            raise
        specs = specs_for(getattr(torch, plan["dtype"]))
        plan["slot_bytes"] = slot_bytes(bucket_layout(specs, s.bucket_bytes))
        link.put_json("plan", plan)
        return plan

    def describe(self) -> str:
        return ", ".join(
            f"server {i}: {r.transport}"
            + (f" from rank {r.trainer_rank}" if r.transport == "colocated" else "")
            for i, r in enumerate(self.routes)
        )

    # ---- one update -------------------------------------------------------------------------

    def send(
        self,
        version: int,
        specs: list[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
        announce: Callable[[int], None] = lambda _: None,
        meta: dict | None = None,
    ) -> None:
        """Stream policy `version` to every server and return once all hold it (collective).

        Rank 0 offers `specs` (with `meta`, what else the servers need to know of the tensors: a
        LoRA adapter's adapter_config), then calls `announce(version)` (the orchestrator then asks
        the servers to receive). Raises TransferRefused when a server's model does not fit the specs (no server
        changed), TransferTimeout when a side did not answer within `transfer_timeout_s`."""
        assert self.link is not None, "connect() first"
        until = deadline(self.settings.transfer_timeout_s)
        layout = bucket_layout(specs, self.settings.bucket_bytes)
        if self.rank == 0:
            self._forget(version, len(layout))  # keys left by an earlier attempt at this version
            self._offer(version, specs, meta or {}, announce, until)
        else:
            self.link.wait(
                [f"go/{version}"], until, lambda _: self._late(version, "rank 0 did not start the transfer")
            )
            if refusal := self.link.get(f"go/{version}").decode():
                raise TransferRefused(f"{self.side}: the servers refused policy version {version}: {refusal}")
        self._stream(version, layout, tensors, until)
        waited_for = range(self.num_servers) if self.rank == 0 else self.consumers
        done = [f"done/{version}/{i}" for i in waited_for]
        self.link.wait(
            done, until, lambda m: self._late(version, f"server(s) {indices(m)} did not finish receiving")
        )
        failures = [f"server {k.rsplit('/', 1)[-1]}: {e}" for k in done if (e := self.link.get(k).decode())]
        if failures:
            raise TransferError(
                f"{self.side}: policy version {version} failed on the servers: {'; '.join(failures)}"
            )
        if self.rank == 0:
            self._forget(version, len(layout))

    def _offer(
        self, version: int, specs: list[TensorSpec], meta: dict, announce: Callable[[int], None], until: float
    ) -> None:
        """Rank 0: offer, wait until every server accepted or refused, then go (or abandon)."""
        link = self.link
        assert link is not None
        offer = {
            "specs": [spec.to_json() for spec in specs],
            "bucket_bytes": self.settings.bucket_bytes,
            "meta": meta,
        }
        link.put_json(f"offer/{version}", offer)
        announce(version)
        ready = [f"ready/{version}/{i}" for i in range(self.num_servers)]

        def late(missing: list[str]) -> str:
            what = f"server(s) {indices(missing)} did not start receiving"
            return self._late(version, what) + "; is the orchestrator running?"

        link.wait(ready, until, late)
        refusals = [f"server {i}: {r}" for i, key in enumerate(ready) if (r := link.get(key).decode())]
        link.put(f"go/{version}", "; ".join(refusals))
        if refusals:
            raise TransferRefused(
                f"{self.side}: the servers refused policy version {version}: {'; '.join(refusals)}"
            )

    def _late(self, version: int, what: str) -> str:
        return f"policy version {version}: {what} within {self.settings.transfer_timeout_s:g} s (weights.transfer_timeout_s)"

    def _stream(
        self, version: int, layout: list[Bucket], tensors: Iterable[tuple[str, torch.Tensor]], until: float
    ) -> None:
        sends = self.rank == 0 and self.group is not None
        if not (sends or self.consumers):
            for _ in tensors:  # the gather is collective: take part, keep nothing
                pass
            return
        slots = self._slots(slot_bytes(layout))
        pending: list = [None] * SLOTS
        stream = iter(tensors)
        for k, bucket in enumerate(layout):
            slot = k % SLOTS
            if pending[slot] is not None:
                self._sent(pending[slot], version, k - SLOTS, len(layout))
                pending[slot] = None
            if self.consumers and k >= SLOTS:
                self._wait_freed(version, k - SLOTS, until)
            flat = slots[slot][: bucket.nbytes].view(bucket.dtype)
            for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
                tensor = self._next(stream, spec)
                flat[offset : offset + spec.numel].copy_(tensor.reshape(-1))
            if sends:
                pending[slot] = broadcast(self.group, slots[slot][: bucket.nbytes])
            if self.consumers:
                sync(self.device)
                self.link.put(f"filled/{version}/{self.rank}/{k}", "")
        if next(stream, None) is not None:
            raise TransferError(f"{self.side}: the weight stream yielded more tensors than its specs")
        for k in range(max(0, len(layout) - SLOTS), len(layout)):
            if pending[k % SLOTS] is not None:
                self._sent(pending[k % SLOTS], version, k, len(layout))

    def _sent(self, work: dist.Work, version: int, k: int, buckets: int) -> None:
        """Wait for bucket k's broadcast; a failed or timed-out one (the group's own timeout,
        weights.transfer_timeout_s) ends the run with one line naming the version and bucket."""
        try:
            work.wait()
        except RuntimeError as e:
            raise TransferError(
                f"{self.side}: policy version {version}: bucket {k + 1} of {buckets} was not sent: {collective_failure(e)}"
            ) from None

    def _next(self, stream: Iterator[tuple[str, torch.Tensor]], spec: TensorSpec) -> torch.Tensor:
        """The stream's next tensor, which must be the one `spec` announced."""
        name, tensor = next(stream, (None, None))
        if tensor is None or name != spec.name or tensor.shape != spec.shape or tensor.dtype != spec.dtype:
            got = "nothing" if tensor is None else f"{name} {list(tensor.shape)} {tensor.dtype}"
            raise TransferError(
                f"{self.side}: the weight stream yielded {got} where its specs say {spec.name} {spec.describe()}"
            )
        return tensor

    def _slots(self, nbytes: int) -> list[torch.Tensor]:
        if self.shared is not None:
            if self.shared.tensors[0].numel() < nbytes:
                raise TransferError(
                    f"{self.side}: a bucket of {nbytes} bytes does not fit the shared buffers sized at start"
                )
            return self.shared.tensors
        if not self.local or self.local[0].numel() < nbytes:
            self.local = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)]
        return self.local

    def _wait_freed(self, version: int, bucket: int, until: float) -> None:
        keys = [f"freed/{version}/{i}/{bucket}" for i in self.consumers]
        self.link.wait(
            keys,
            until,
            lambda m: (
                f"policy version {version}: colocated server(s) {indices([k.rsplit('/', 1)[0] for k in m])} did not copy bucket {bucket} in time"
            ),
        )

    def _forget(self, version: int, buckets: int) -> None:
        """Delete the keys of one update (the store would otherwise grow every step)."""
        keys = [f"offer/{version}", f"go/{version}"]
        for i, route in enumerate(self.routes):
            keys += [f"ready/{version}/{i}", f"done/{version}/{i}"]
            if route.transport == "colocated":
                keys += [f"filled/{version}/{route.trainer_rank}/{k}" for k in range(buckets)]
                keys += [f"freed/{version}/{i}/{k}" for k in range(buckets)]
        self.link.delete(keys)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None
