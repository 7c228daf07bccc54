"""Byte buffers one process allocates and another maps: CUDA IPC on a GPU, shared memory on CPU.

The owner (a trainer rank) allocates the buffers once and publishes a `handle` (bytes); a process
on the same device (a colocated server) opens it and sees the same memory, so a bucket the owner
packs is copied device to device by the server, without a pass through the host.

CUDA: the handle holds torch's IPC rebuild arguments and the GPU's UUID; the opener replaces the
device index with its own index of that GPU (the two processes may number their visible GPUs
differently). CPU: named POSIX shared memory segments (multiprocessing.shared_memory), removed
by the owner on close.

Imports only torch and the standard library: vLLM's worker extension uses it too.
"""

import contextlib
import os
import pickle
from multiprocessing import resource_tracker, shared_memory

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_gpu_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} (the trainer's) is not visible to this process (CUDA_VISIBLE_DEVICES)")


class SharedBuffers:
    """`count` buffers of `nbytes` on `device` that another process on that device can open."""

    def __init__(self, count: int, nbytes: int, device: torch.device) -> None:
        self.device = device
        self._segments: list[shared_memory.SharedMemory] = []
        if device.type == "cuda":
            self.tensors = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
            rebuild_args = [reduce_tensor(t)[1] for t in self.tensors]
            self.handle = pickle.dumps(("cuda", gpu_uuid(device), rebuild_args))
        else:
            for i in range(count):
                name = f"tandem-weights-{os.getpid()}-{id(self):x}-{i}"
                self._segments.append(shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1)))
            self.tensors = [torch.frombuffer(s.buf, dtype=torch.uint8)[:nbytes] for s in self._segments]
            self.handle = pickle.dumps(("cpu", nbytes, [s.name for s in self._segments]))

    def close(self) -> None:
        self.tensors = []
        for segment in self._segments:
            _close(segment)
            segment.unlink()
        self._segments = []


class OpenedBuffers:
    """The buffers of a `SharedBuffers.handle`, mapped into this process."""

    def __init__(self, handle: bytes) -> None:
        kind, *rest = pickle.loads(handle)
        self._segments: list[shared_memory.SharedMemory] = []
        if kind == "cuda":
            uuid, rebuild_args = rest
            index = local_gpu_index(uuid)
            self.tensors = []
            for args in rebuild_args:
                args = list(args)
                args[6] = index  # storage_device of rebuild_cuda_tensor
                self.tensors.append(rebuild_cuda_tensor(*args))
        else:
            nbytes, names = rest
            for name in names:
                segment = shared_memory.SharedMemory(name=name)
                if not name.startswith(f"tandem-weights-{os.getpid()}-"):
                    # The owner removes the segment; this process's resource tracker must not
                    # (Python < 3.13 registers every segment it opens and unlinks it at exit).
                    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
                self._segments.append(segment)
            self.tensors = [torch.frombuffer(s.buf, dtype=torch.uint8)[:nbytes] for s in self._segments]

    def close(self) -> None:
        self.tensors = []
        for segment in self._segments:
            _close(segment)
        self._segments = []


def _close(segment: shared_memory.SharedMemory) -> None:
    """Unmap a segment; one still referenced by a live tensor view stays mapped until exit."""
    with contextlib.suppress(BufferError):
        segment.close()
