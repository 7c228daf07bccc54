"""Process groups, the device mesh and FSDP2 settings, shared by the SFT and RL trainers.

A trainer always runs inside a process group: under `torchrun` it joins the launched group
(NCCL on GPU, gloo on CPU); started as a plain process it forms a group of one. Sharding is
therefore one code path: `fully_shard` on every decoder layer and then on the root, which
holds the embeddings, the final norm and the (possibly tied) output head. tandem's own models
are parallelised by their family's parallelize.py over the meshes built here (`build_mesh`,
`build_cp_mesh`);
Hugging Face models (model.impl = "hf") by `apply_fsdp` below.
"""

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tandem.cli import UserError
from tandem.models.loading import resolve_device
from tandem.models.parallelism import OWN_DTYPE, own_dtype_units

TIMEOUT = timedelta(minutes=10)
"""How long a collective may wait for the other ranks before the process fails."""


@dataclass(frozen=True)
class World:
    """Where this process sits: its rank among `size` and the device it computes on."""

    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> World:
    """Join torchrun's process group, or form a group of one when not launched by torchrun."""
    torch_device = resolve_device(device)
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    rank = int(os.environ["RANK"]) if launched else 0
    size = int(os.environ["WORLD_SIZE"]) if launched else 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    if torch_device.type == "cuda":
        torch_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(torch_device)
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if launched:
            dist.init_process_group(backend, timeout=TIMEOUT, device_id=_device_id(torch_device))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT)
    return World(rank=rank, size=size, local_rank=local_rank, device=torch_device)


def build_mesh(world: World, ep: int) -> DeviceMesh:
    """The 2-D (efsdp, ep) mesh over all ranks, ep innermost (models/parallelism.py)."""
    if world.size % ep:
        raise UserError(f"trainer.parallel.ep = {ep} does not divide the world size {world.size}")
    return init_device_mesh(world.device.type, (world.size // ep, ep), mesh_dim_names=("efsdp", "ep"))


def check_cp(world: World, cp: int) -> None:
    if world.size % cp:
        raise UserError(f"trainer.parallel.cp = {cp} does not divide the world size {world.size}")


def build_cp_mesh(world: World, cp: int) -> DeviceMesh | None:
    """The 2-D (dp, cp) mesh over the same ranks, cp innermost; None without context parallelism."""
    check_cp(world, cp)
    if cp == 1:
        return None
    return init_device_mesh(world.device.type, (world.size // cp, cp), mesh_dim_names=("dp", "cp"))


def data_shard(world: World, cp: int) -> tuple[int, int]:
    """(index, count) of this rank's data-parallel group: the cp consecutive ranks of a context-
    parallel group read the same micro-batches, each computing its own columns of them."""
    check_cp(world, cp)
    return world.rank // cp, world.size // cp


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


@contextlib.contextmanager
def distributed(device: str = "auto") -> Iterator[World]:
    """init_distributed, and shutdown when the block ends: completed when it returned, not
    completed when it raised."""
    world = init_distributed(device)
    completed = False
    try:
        yield world
        completed = True
    finally:
        shutdown(completed)


def shutdown(completed: bool = False) -> None:
    """Tear the process groups down. After a `completed` run every rank first waits for the
    others, so none closes its connections while another still talks to it; after a failure
    nothing waits (the other ranks may never arrive). A trainer process then ends through
    `end_process`."""
    if not dist.is_initialized():
        return
    if completed:
        barrier()
    dist.destroy_process_group()


def end_process() -> NoReturn:
    """Exit a trainer process whose run completed (and whose groups are shut down) with status 0,
    without the interpreter's finalization.

    Why: a gloo rank sometimes aborted after its run had finished and its group was destroyed
    ("terminate called without an active exception", SIGABRT): three times in CI's 2-rank CPU
    runs, with and without a barrier first; never in 43 runs here. The likely mechanism (not
    reproduced): a gloo worker thread still holds a collective's tensors when Python starts
    finalizing, releasing one takes the GIL, the interpreter ends that thread, and the unwind
    through a C++ destructor terminates the process (pytorch/pytorch#179291 describes this
    class). Skipping finalization avoids it whatever the thread. A finished trainer leaves it
    nothing to do: its files are written and closed, and the buffers are flushed here. Ranks
    started by multiprocessing (tests/trainer/cp_worker.py) always ended this way (os._exit) and
    never aborted."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    ctypes.CDLL(None).fflush(None)  # C stdio buffers (native libraries' output)
    os._exit(0)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small tensor over ranks (in place) and return it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a Hugging Face decoder (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList to shard")
    return layers


def compute_dtype_of(device: torch.device, weights: torch.dtype, compute: str = "auto") -> torch.dtype:
    """The dtype forward and backward run in: compute = "auto" is bf16 for fp32 weights on GPU,
    otherwise the weights' own dtype."""
    if compute == "auto":
        compute = "bfloat16" if device.type == "cuda" and weights == torch.float32 else "weights"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(compute, weights)


def mixed_precision(
    device: torch.device, weights: torch.dtype, compute: str = "auto", adapters: bool = False
) -> MixedPrecisionPolicy:
    """FSDP2 compute dtype policy; gradients are always reduced in fp32 when computing in bf16.

    LoRA `adapters` are float32 over a base of any dtype: parameters are cast to the compute dtype
    then whenever it is not float32 (the casts happen in FSDP's all-gather).
    """
    target = compute_dtype_of(device, weights, compute)
    if target == weights and not (adapters and target != torch.float32):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=target, reduce_dtype=torch.float32)


def master_in_optimizer_policy(world: World) -> MixedPrecisionPolicy:
    """FSDP2 policy for parameters held in the compute dtype, their fp32 masters in the optimizer
    (trainer/master_weights.py): all-gathers cast nothing; gradients are reduced in fp32 where
    ranks reduce (FSDP then rounds each micro-batch's reduced gradient to the parameters' dtype),
    and on one rank, where nothing is reduced, not cast at all."""
    return MixedPrecisionPolicy(reduce_dtype=torch.float32 if world.size > 1 else None)


def apply_fsdp(model: nn.Module, policy: MixedPrecisionPolicy) -> nn.Module:
    """Shard each decoder layer (and first, its submodules of another dtype: a router that
    transformers keeps in fp32), then the root; returns the same (now sharded) module."""
    for layer in decoder_layers(model):
        for unit in own_dtype_units(layer):
            fully_shard(unit, mp_policy=OWN_DTYPE)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
