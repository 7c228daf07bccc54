"""Shared setup for the SFT tests: a tiny model, a small fast config, one thread per process.

The CI machine has two cores shared by several test processes; one intra-op thread per process
avoids OpenMP oversubscription, which made these tiny runs 7x slower.
"""

import os
from pathlib import Path

import torch

from tandem.models.tiny import build_tiny_model

torch.set_num_threads(1)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
TINY = {"num_layers": 2, "hidden_size": 64, "head_dim": 16, "intermediate_size": 128}


def tiny_model(root: Path) -> Path:
    return build_tiny_model(out=root / "tiny", **TINY)


def sft_args(model: Path, run_dir: Path, steps: int = 8, **extra: object) -> list[str]:
    """Command-line arguments of a small SFT run (fp32, CPU)."""
    args = {
        "model.name": str(model),
        "model.device": "cpu",
        "run-dir": str(run_dir),
        "max-steps": steps,
        "seq-len": 256,
        "data.num-examples": 200,
        "data.batch-size": 16,
        "data.micro-batch-size": 2,
        "optim.lr": 3e-3,
        "optim.warmup-steps": 2,
        "optim.schedule": "cosine",
        "optim.weight-decay": 0.01,
        "optim.max-grad-norm": 1.0,
        "ckpt.keep": 0,
        "eval.final": False,
        **extra,
    }
    out: list[str] = []
    for key, value in args.items():
        out += [f"--{key}", str(value)]
    return out
