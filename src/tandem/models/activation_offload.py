"""Activation offload: what autograd saves in a block's forward waits in pinned host memory
instead of on the GPU, and comes back for the backward.

Invariants:
- Copies run on a side stream, so they overlap the compute: a block's tensors go to the host
  while the next blocks compute, and come back while the block after them (in backward order)
  computes. Each copy is ordered with the kernels around it by events, and the allocator is told
  (`record_stream`) that a tensor's memory is in use until its copy has finished.
- Bounded GPU memory: a block's forward starts only once the copies of the block two before it
  have reached the host, and backward fetches the block it needs and the one after it (the
  previous block in forward order), no further ahead.
- Under full activation checkpointing (applied inside these hooks) a block saves only its input
  through autograd, so only that goes to the host: the GPU then holds no block's activations
  but the one being recomputed. Selective checkpointing keeps its tensors outside the hooks
  (ParallelConfig refuses it with offload).
- Parameters, non-float tensors (masks, indices) and host tensors stay where they are. The host
  copy is always contiguous: a copy between the GPU and a strided host tensor goes through a
  pageable staging buffer and a copy on the CPU, synchronously (the first version kept the
  strides on the host and ran at a tenth of the speed of no offload). A tensor comes back with
  the strides it left with (a compiled block's backward asserts them; the GPU makes the strided
  copy); only an expanded one (a zero stride) comes back contiguous.
- The hooks are entered outside the compiled region (the block's forward is compiled inside
  them), since Dynamo cannot trace into saved_tensors_hooks.
"""

import weakref
from collections.abc import Callable

import torch
from torch import nn

THROTTLE = 2  # a block's forward waits for the copies of the block this many before it


class _Saved:
    """One offloaded tensor: its host copy, and on the way back its GPU copy."""

    __slots__ = ("block", "device", "stride", "host", "gpu", "ready", "__weakref__")

    def __init__(self, block: "_BlockCall", t: torch.Tensor, host: torch.Tensor) -> None:
        self.block = block  # keeps its block call alive while autograd holds this tensor
        self.device, self.host = t.device, host
        self.stride = None if 0 in t.stride() else t.stride()
        self.gpu: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class _BlockCall:
    """The tensors one forward call of one block offloaded (weakly: autograd owns them)."""

    def __init__(self, offloader: "ActivationOffloader", previous: "_BlockCall | None") -> None:
        self.offloader = offloader
        self.previous = None if previous is None else weakref.ref(previous)
        self.saved: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.copied: torch.cuda.Event | None = None  # the last of its copies to the host
        self.fetched = False

    def pack(self, t: torch.Tensor) -> object:
        if isinstance(t, nn.Parameter) or not t.is_floating_point() or t.device.type != "cuda":
            return t
        stream = self.offloader.stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)
        self.copied = stream.record_event()
        saved = _Saved(self, t, host)
        self.saved.add(saved)
        return saved

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        self.fetch()
        previous = None if self.previous is None else self.previous()
        if previous is not None:
            previous.fetch()  # backward needs it next: its copies overlap this block's backward
        if packed.gpu is None:  # (unpacked twice)
            self._fetch_one(packed)
        compute = torch.cuda.current_stream(packed.device)
        compute.wait_event(packed.ready)
        gpu, packed.gpu = packed.gpu, None
        gpu.record_stream(compute)
        return gpu

    def fetch(self) -> None:
        if self.fetched:
            return
        self.fetched = True
        for saved in list(self.saved):
            self._fetch_one(saved)

    def _fetch_one(self, saved: _Saved) -> None:
        stream = self.offloader.stream(saved.device)
        with torch.cuda.stream(stream):
            host, where = saved.host, {"dtype": saved.host.dtype, "device": saved.device}
            if saved.stride is None:
                saved.gpu = torch.empty(host.size(), **where)
            else:
                saved.gpu = torch.empty_strided(host.size(), saved.stride, **where)
            saved.gpu.copy_(host, non_blocking=True)
            saved.ready = stream.record_event()


class ActivationOffloader:
    """The side stream and the order of block calls of one model."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._calls: list[weakref.ref[_BlockCall]] = []

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for one forward call of a block (the calls chain in forward order)."""
        earlier = [call for call in (ref() for ref in self._calls) if call is not None][-THROTTLE:]
        if len(earlier) == THROTTLE and earlier[0].copied is not None:
            torch.cuda.current_stream().wait_event(earlier[0].copied)
        call = _BlockCall(self, earlier[-1] if earlier else None)
        self._calls = [weakref.ref(c) for c in (*earlier, call)]
        return torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack)


def offloaded_forward(forward: Callable[..., torch.Tensor], offloader: ActivationOffloader) -> Callable:
    """`forward` with its saved activations offloaded by `offloader`."""

    def run(*args: object, **kwargs: object) -> torch.Tensor:
        with offloader.hooks():
            return forward(*args, **kwargs)

    return run
