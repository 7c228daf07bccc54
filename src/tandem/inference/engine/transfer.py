"""Host↔device copies that never stall the CUDA stream.

The engine keeps one step queued on the GPU while the CPU prepares the next (core.py), so no
copy on the launch path may wait for the stream: a plain `torch.tensor(values, device=cuda)` or a
copy from pageable memory synchronises with everything queued before it. Host data therefore goes
through pinned memory with `non_blocking=True`, and results come back into pinned memory with an
event to wait on. On CPU these are plain tensors.
"""

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, possibly nested) as a tensor on `device`, copied without a stream sync."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without a stream sync (pinned first on CUDA)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_to(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a CPU tensor into `dst` (a persistent device buffer) without a stream sync."""
    dst.copy_(host.pin_memory() if dst.is_cuda else host, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host asynchronously; `get()` waits for them (GIL released)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.ready: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, tensor in zip(self.host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = list(tensors)

    def get(self) -> list[torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.host
