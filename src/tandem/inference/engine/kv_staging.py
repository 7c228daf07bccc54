"""Staging buffers for prefill on other servers: a prompt's blocks handed from one server to
another of the same machine through memory both can map, not through HTTP bodies.

The prefill server's engine owns `count` buffers of `nbytes` (CUDA IPC on its GPU, named shared
memory on CPU: tandem.transport.shared_buffers), allocated at its first staged export. An export
packs the prompt's blocks into one buffer (kv_prefix.pack) and waits for the copy; the answer
carries the buffers' handle and where the parts lie. The decode server's engine maps the buffers
once per handle and copies the blocks straight into its cache: on GPUs, device to device (peer to
peer between two GPUs: the prefill server's GPU must be visible to the decode server), with no
pass through the host.

Who may use a buffer: the prefill server lends each one to one export at a time (`StagingLeases`, in its
server process: prefill.py) until the decode server releases it (POST /v1/kv/release) or
STAGING_LEASE_S (api.py) pass. The
decode server copies only within half of that of the answer and waits for its copy to finish
before it releases the buffer, so a buffer is never reused under a copy that is reading it.
"""

import os
import time

import torch

from tandem.inference.engine.api import STAGING_LEASE_S as LEASE_S
from tandem.inference.engine.kv_link import KVLink, Transfer
from tandem.inference.engine.kv_prefix import Prefix, pack, unpack
from tandem.transport.shared_buffers import OpenedBuffers, SharedBuffers


class StagingBuffers:
    """The exporting engine's buffers (allocated at first use)."""

    def __init__(self, count: int, nbytes: int, device: torch.device) -> None:
        self.count, self.nbytes, self.device = count, nbytes, device
        self.buffers: SharedBuffers | None = None
        self.sending: dict[int, Transfer] = {}  # buffers a kv link is sending (kv_link.py)

    def stage(self, prefix: Prefix, index: int) -> dict:
        """Pack `prefix` into buffer `index` and wait for the copy; what the importer needs."""
        if not 0 <= index < self.count:
            raise ValueError(f"staging buffer {index} does not exist (there are {self.count})")
        if index in self.sending and not self.sending[index].done.is_set():
            raise ValueError(f"staging buffer {index} is still being sent")
        if self.buffers is None:
            if self.device.type != "cuda" and _shm_free() < self.count * self.nbytes:
                raise ValueError(  # (writing past a full /dev/shm would kill the process with SIGBUS)
                    f"/dev/shm has {_shm_free() >> 20} MiB free, less than {self.count} staging buffers of "
                    f"{self.nbytes >> 20} MiB (prefill.staging_buffers, prefill.staging_mb)"
                )
            self.buffers = SharedBuffers(self.count, self.nbytes, self.device)
        packed = pack(prefix, self.buffers.tensors[index])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return {**packed, "handle": self.buffers.handle, "buffer": index}

    def send(self, link: KVLink, index: int, nbytes: int, lease: int) -> None:
        """Queue the first `nbytes` of buffer `index` on `link` (which must be staged: `lease`
        holds it, and tags the transfer)."""
        if self.buffers is None or not 0 <= index < self.count or not 0 < nbytes <= self.nbytes:
            raise ValueError(f"staging buffer {index} holds no {nbytes} bytes to send")
        self.sending[index] = link.send(self.buffers.tensors[index][:nbytes], lease)

    def close(self) -> None:
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None


class OpenedStaging:
    """The importing engine's mappings of prefill servers' buffers, one per handle."""

    def __init__(self) -> None:
        self.opened: dict[bytes, OpenedBuffers] = {}

    def prefix(self, staged: dict) -> Prefix:
        """The staged prefix, its parts views of the mapped buffer. ValueError if the answer is
        older than half a lease (the buffer may be lent again by now) or malformed."""
        if time.monotonic() - staged["received"] > LEASE_S / 2:
            raise ValueError(f"the staged blocks waited more than {LEASE_S / 2:g} s to be copied")
        handle = staged["handle"]
        if handle not in self.opened:
            self.opened[handle] = OpenedBuffers(handle)
        buffers = self.opened[handle].tensors
        index = staged["buffer"]
        if not 0 <= index < len(buffers):
            raise ValueError(f"staging buffer {index} does not exist (there are {len(buffers)})")
        return unpack(staged, buffers[index])

    def close(self) -> None:
        for opened in self.opened.values():
            opened.close()
        self.opened.clear()


def _shm_free() -> int:
    """Bytes free in /dev/shm, where POSIX shared memory lives on Linux."""
    stat = os.statvfs("/dev/shm")
    return stat.f_bavail * stat.f_frsize
