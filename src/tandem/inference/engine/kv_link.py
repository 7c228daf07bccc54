"""Prompts' blocks sent between the engines of any two machines (`prefill.transport = "p2p"`).

A (prefill, decode) pair of servers shares a link: a process group of two ranks (the prefill
engine rank 0, the decode engine rank 1; NCCL between GPUs, gloo on CPU) over a TCPStore that the
prefill engine hosts, and on each side a thread that runs the link's transfers one at a time, so
that no engine step waits for a slow peer and every transfer has a deadline.

How a pair meets (inference/prefill.py drives it over HTTP):
1. The decode server asks the prefill server for a link (POST /v1/kv/link); the prefill engine
   starts its store (once, on a port the OS picks), numbers the link and starts its side, which
   waits for the peer; the answer names the link and the store's port.
2. The decode engine joins through the store at the prefill server's host and that port; both
   threads run one warm-up transfer (NCCL sets up its communicator there) and the link is
   ready. Until then, and for good if it fails, that prefill server's prompts travel by HTTP.

A transfer: after a staged export (the blocks packed into one of the prefill server's staging
buffers, kv_staging.py) the decode server asks for them (POST /v1/kv/send): the prefill engine
queues a send of the buffer's packed bytes and answers at once; the decode engine queues a
receive into a buffer of the transfer's own; the decode server polls whether it is over (engine
steps run meanwhile) and only then adopts the blocks, in a core call of its own.
Point-to-point operations between two ranks are matched in the order they are issued, so both
sides must queue a pair's transfers in one order: the decode server asks for one transfer at a
time per link (prefill.py holds the link's lock from the send request until the receive is
queued). Each transfer's payload follows a header of its tag (the export's lease) and size, which
the receiving side checks before it takes the payload: a pair out of step fails its link rather
than adopting another export's bytes (gloo completes a receive from a shorter send). Links are
numbered at random, so a number from before a restart names no link of the new process.

Failure: a transfer (or the warm-up) that does not complete by its deadline fails the link on
that side: its group is aborted (NCCL) and its thread ends. The decode server then drops the
link on both sides and that prefill server's prompts travel by HTTP until it forms a new link
(LINK_RETRY_S later, inference/prefill.py). A staging buffer whose send has not completed is not
packed again (kv_staging.py `StagingBuffers.sending`). A prefill side left idle by a decode server
that was killed is closed when a later link opens (`KVLinks.open`, IDLE_LINK_S).
"""

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.transport.weight_link import process_group

log = logging.getLogger("tandem.inference")

IDLE_LINK_S = 600.0
"""A prefill-side link without a transfer for this long is closed when the next link opens: its
decode server most likely ended without closing it (killed). A live one that was only idle loses
one transfer to it (that prompt is computed there) and forms a new link after LINK_RETRY_S."""

GROUP_TIMEOUT_MARGIN_S = 60.0
"""The groups' own timeout exceeds every deadline here by this much, so that NCCL's watchdog
(which may end the process) never fires before a link has aborted itself."""


@dataclass
class Transfer:
    """One send or receive on a link; `done` is set when it completed or failed (`error`)."""

    op: str  # "send" | "recv"
    tensor: torch.Tensor
    tag: int  # checked by the receiver: the export's lease (0 for the warm-up)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class KVLink:
    """One side of a (prefill, decode) pair: its group and the thread that runs its transfers."""

    def __init__(
        self,
        name: str,
        connect: Callable[[], dist.Store],
        rank: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.name, self.rank, self.device, self.timeout_s = name, rank, device, timeout_s
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self._group: dist.ProcessGroup | None = None
        self._closed = False
        self._lock = threading.Lock()  # a transfer is queued only while the link has not ended
        self.last_used = time.monotonic()  # when it was opened or its last transfer was queued
        self._thread = threading.Thread(
            target=self._run, args=(connect,), name=f"kv-link-{name}", daemon=True
        )
        self._thread.start()

    @property
    def state(self) -> str:
        """ "ready", "connecting", or "failed: why"."""
        if self.error is not None:
            return f"failed: {self.error}"
        return "ready" if self.ready.is_set() else "connecting"

    def send(self, tensor: torch.Tensor, tag: int) -> Transfer:
        """Queue a send of `tensor` (whose contents must stay until the transfer is done)."""
        return self._submit(Transfer("send", tensor, tag))

    def receive(self, nbytes: int, tag: int) -> Transfer:
        """Queue a receive of the peer's next send, which must be `tag`'s `nbytes` bytes, into a
        buffer of its own (`wait` for it)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._submit(Transfer("recv", buffer, tag))

    def wait(self, transfer: Transfer) -> torch.Tensor:
        """The transfer's tensor once it is done; RuntimeError if it failed or missed its deadline."""
        if not transfer.done.wait(self.timeout_s + GROUP_TIMEOUT_MARGIN_S / 2):
            self._fail(
                TimeoutError(f"the link's thread did not finish a transfer within {self.timeout_s:g} s")
            )
            raise RuntimeError(f"kv link {self.name}: a {transfer.op} did not finish")
        if transfer.error is not None:
            nbytes = transfer.tensor.numel()
            raise RuntimeError(
                f"kv link {self.name}: a {transfer.op} of {nbytes} bytes failed: {transfer.error}"
            )
        return transfer.tensor

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._abort()

    def _submit(self, transfer: Transfer) -> Transfer:
        if self.error is None and not self._closed:  # (the peer may see the warm-up end a moment earlier)
            self.ready.wait(min(1.0, self.timeout_s))
        with self._lock:
            if not self.ready.is_set() or self.error is not None or self._closed:
                raise RuntimeError(f"kv link {self.name} is {'closed' if self._closed else self.state}")
            self._queue.put(transfer)
            self.last_used = time.monotonic()
        return transfer

    def _run(self, connect: Callable[[], dist.Store]) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # (NCCL's communicator and streams on the engine's GPU)
            store = dist.PrefixStore(f"kv/{self.name}", connect())
            timeout = timedelta(seconds=self.timeout_s + GROUP_TIMEOUT_MARGIN_S)
            self._group = process_group(store, self.rank, 2, self.device, timeout)
            warm_up = torch.zeros(1, dtype=torch.uint8, device=self.device)
            self._transfer(Transfer("send" if self.rank == 0 else "recv", warm_up, 0))
            self.ready.set()
            while (transfer := self._queue.get()) is not None:
                try:
                    self._transfer(transfer)
                except BaseException as e:  # noqa: BLE001 — the transfer's caller hears of it
                    transfer.error = e
                    if not self._closed:  # (before `done`: a caller that hears of it finds the link failed)
                        self._fail(e)
                    raise
                finally:
                    transfer.done.set()
        except BaseException as e:  # noqa: BLE001 — a thread's end: the link is failed
            if not self._closed:
                self._fail(e)
        self._fail_pending()

    def _transfer(self, transfer: Transfer) -> None:
        """The header (tag, size), checked on the receiving side, then the payload."""
        nbytes = transfer.tensor.numel()
        if transfer.op == "send":
            self._one("send", torch.tensor([transfer.tag, nbytes], dtype=torch.int64, device=self.device))
            self._one("send", transfer.tensor)
            return
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        self._one("recv", header)
        tag, size = header.tolist()
        if (tag, size) != (transfer.tag, nbytes):
            raise RuntimeError(
                f"out of step with the peer: expected {nbytes} bytes of export {transfer.tag}, "
                f"the peer sent {size} bytes of export {tag}"
            )
        self._one("recv", transfer.tensor)

    def _one(self, op: str, tensor: torch.Tensor) -> None:
        assert self._group is not None
        tensors, peer = [tensor], 1 - self.rank
        work = self._group.send(tensors, peer, 0) if op == "send" else self._group.recv(tensors, peer, 0)
        # (NCCL: with a timeout the host waits for completion, or raises when it passes)
        work.wait(timedelta(seconds=self.timeout_s))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            log.warning("kv link %s failed: %s", self.name, error)
        self._abort()

    def _abort(self) -> None:
        group = self._group
        if group is not None and isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):
            group.abort()  # (ends a transfer that waits for a peer; gloo's end at their timeout)

    def _fail_pending(self) -> None:
        with self._lock:  # (error or _closed is set: nothing is queued after this)
            while True:
                try:
                    transfer = self._queue.get_nowait()
                except queue.Empty:
                    return
                if transfer is not None:
                    transfer.error = RuntimeError(f"kv link {self.name} ended")
                    transfer.done.set()


class KVLinks:
    """An engine's links, by number (random: see the module's docstring): those it opened as a
    prefill server (peers meet at its store) and those it joined as a decode server. A failed
    link stays, so that its state can be read, until it is closed or the next link is opened.
    A decode server that ends without closing its link (killed) leaves the prefill side idle,
    for its peer's death is noticed only by a transfer: such a side is closed when the next link
    opens once it has been idle for `idle_s` (IDLE_LINK_S), so a decode server that restarts
    does not pile up NCCL communicators on its prefill server."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device, self.timeout_s = device, timeout_s
        self.links: dict[int, KVLink] = {}
        self._store: dist.TCPStore | None = None
        self.idle_s = IDLE_LINK_S

    def open(self) -> dict:
        """A new link's prefill side, waiting for its peer: {"link": its number, "port": the store's}."""
        now = time.monotonic()
        for number, link in list(self.links.items()):
            idle = link.rank == 0 and now - link.last_used > self.idle_s
            if idle:
                log.info(
                    "kv link %s: no transfer for %.0f s, closed (its peer is likely gone)",
                    link.name,
                    now - link.last_used,
                )
            if idle or link.error is not None:
                self.close(number)
        if self._store is None:
            self._store = dist.TCPStore(
                "127.0.0.1", 0, None, True, timedelta(seconds=self.timeout_s), wait_for_workers=False
            )  # (a master store listens on every interface)
        number, port = self._new_number(), self._store.port
        self.links[number] = KVLink(
            f"p{number}", lambda: self._client("127.0.0.1", port), 0, self.device, self.timeout_s
        )
        return {"link": number, "port": port}

    def join(self, host: str, port: int, link: int) -> int:
        """Join link `link` of the prefill engine whose store is at host:port; this side's number."""
        number = self._new_number()
        self.links[number] = KVLink(
            f"p{link}", lambda: self._client(host, port), 1, self.device, self.timeout_s
        )
        return number

    def _client(self, host: str, port: int) -> dist.Store:
        """A connection of the link's own to the store: a store client serves one call at a time,
        so links sharing one would wait for each other (a side whose peer never joins would hold
        every later link back until its group's timeout)."""
        return dist.TCPStore(host, port, None, False, timedelta(seconds=self.timeout_s))

    def _new_number(self) -> int:
        while (number := 1 + secrets.randbelow(2**52)) in self.links:  # (exact in JSON numbers)
            pass
        return number

    def get(self, number: int) -> KVLink:
        if number not in self.links:
            raise ValueError(f"kv link {number} does not exist here")
        return self.links[number]

    def close(self, number: int) -> None:
        link = self.links.pop(number, None)
        if link is not None:
            link.close()

    def close_all(self) -> None:
        for number in list(self.links):
            self.close(number)
        self._store = None
