"""The ranks of a multi-rank trainer (rl's trainer, sft) die with their torchrun agent.

torchrun starts each rank in a session of its own, so SIGKILL of the trainer process `rl`
started (the agent), or of a `torchrun ... -m tandem.trainer.sft.cli`, reached the agent alone:
its ranks ran on, holding their GPUs and ports, until their own timeouts or the end of training
(here the RL ranks wait for rollouts that never come, the SFT ranks have 100000 steps to go)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import alive, wait_for

from tandem.models.tiny import build_tiny_model


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def has_loaded_torch(pid: int) -> bool:
    """The rank is past its first lines (where it arms its death with the agent): it imports torch."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


RL_TRAINER = "seq_len = 64\nmax_steps = 2\nrollout_timeout_s = 120\n"
SFT = "seq_len = 256\nmax_steps = 100000\n[data]\nnum_examples = 64\nbatch_size = 4\n[eval]\nfinal = false\n"
"""Each trainer's config but its run_dir and model: a run that outlasts the test."""


@pytest.mark.parametrize(
    ("module", "settings"),
    [("tandem.trainer.rl.cli", RL_TRAINER), ("tandem.trainer.sft.cli", SFT)],
    ids=["rl", "sft"],
)
def test_the_ranks_of_a_killed_torchrun_agent_die_with_it(tmp_path: Path, module: str, settings: str) -> None:
    model = build_tiny_model(
        out=tmp_path / "model", num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64
    )
    config = tmp_path / "trainer.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n{settings}[model]\nname = "{model}"\n')
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", module, "@", str(config)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        wait_for(lambda: len(children(agent.pid)) == 2, 60, "torchrun to start two ranks")
        ranks = children(agent.pid)
        wait_for(lambda: all(has_loaded_torch(r) for r in ranks), 60, "both ranks to import torch")
        assert all(alive(r) for r in ranks)
        agent.kill()
        agent.wait(timeout=10)
        start = time.monotonic()
        wait_for(lambda: not any(alive(r) for r in ranks), 10, "the ranks to die with their agent")
        assert time.monotonic() - start < 10
    finally:
        for pid in [agent.pid, *ranks]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
