"""A benchmark's child process on one or several GPUs of this host: the command (through torchrun
when there are several) and its environment, NVLink multicast off (../shared/MACHINE-NOTES.md)."""

import os
import sys
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def child_command(script: str | Path, nproc: int) -> list[str]:
    """`python script` for one process, `python -m torch.distributed.run ... script` for several."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [sys.executable, *(launcher if nproc > 1 else []), str(script)]


def child_env(nproc: int) -> dict[str, str]:
    """This process's environment, with multicast off where several processes share GPUs."""
    env = dict(os.environ)
    if nproc > 1:
        for key, value in NO_MULTICAST.items():
            env.setdefault(key, value)
    return env
