"""A trainer rank started by torchrun dies with its agent: the RL trainer's
(tandem.trainer.rl.cli, which `rl` starts under torchrun when trainer_nproc > 1) and sft's
(tandem.trainer.sft.cli, run under torchrun by hand or by a job script).

torchrun starts each rank in a session of its own, so the process group that `rl` signals (and a
terminal's Ctrl-C) holds the agent alone. While the agent lives it stops its ranks itself; an
agent killed outright (SIGKILL of the trainer process `rl` started or of a `torchrun ... sft`,
the OOM killer) left them running on without it, holding their GPUs, ports and shared memory.
Each rank therefore asks the kernel for SIGKILL when its parent, the agent, dies: first thing in
its module, before the slow imports, so that an agent killed while its ranks start takes them too
(Linux; elsewhere nothing changes). No process outside torchrun is affected (a single-rank
trainer is `rl`'s own child, which `rl` ties to itself: launch/supervisor.py).
"""

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_torchrun_agent() -> None:
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # (set by torchrun for its ranks)
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
