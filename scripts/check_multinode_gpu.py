"""Multi-node code paths on one machine with 2 GPUs, each GPU standing for a node; prints a table.

1. SFT through torchrun's c10d rendezvous: two agents (`--nnodes 2`, one GPU each, NCCL) against
   one node with two ranks: per-step loss and gradient norm, and their largest difference.
2. A 3-step reverse-text RL run through two node launchers on 127.0.0.1 (inference node on GPU 0
   with the orchestrator, trainer node on GPU 1; `cluster.gpus_per_node = 1`): wall time and
   whether weights/step_3 was published.

    PYTHONPATH=src:WHEELS python3 scripts/check_multinode_gpu.py [--out /tmp/multinode]

`--device cpu` runs the same on CPU (gloo, no GPUs), as a smoke test of the script itself.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tandem.launch.plan import torchrun_command
from tandem.models.tiny import build_tiny_model
from tandem.monitor.metrics import read_metrics
from tandem.net import free_port

ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "4", "TQDM_DISABLE": "1"}


def sft_args(model: Path, run_dir: Path, device: str) -> list[str]:
    settings = {"model.name": model, "model.device": device, "run_dir": run_dir, "max_steps": 5}
    settings |= {"seq_len": 256, "data.num_examples": 256, "data.batch_size": 32, "eval.final": False}
    return [part for k, v in settings.items() for part in (f"--{k}", str(v))]


def gpu(device: str, index: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": str(index) if device == "cuda" else ""}


def sft_check(out: Path, model: Path, device: str) -> None:
    module = ["-m", "tandem.trainer.sft.cli"]
    one = subprocess.run([*torchrun_command(2), *module, *sft_args(model, out / "one", device)], env=ENV)
    rdzv = f"127.0.0.1:{free_port()}"
    agent = [*torchrun_command(1, 2, rdzv, 120), *module, *sft_args(model, out / "two", device)]
    agents = [subprocess.Popen(agent, env={**ENV, **gpu(device, i)}) for i in range(2)]
    codes = [a.wait() for a in agents]
    print(f"\n## SFT, one node x 2 GPUs (exit {one.returncode}) vs two c10d agents x 1 GPU (exit {codes})\n")
    print("| step | loss, 1 node | loss, 2 nodes | grad_norm, 1 node | grad_norm, 2 nodes |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for a, b in zip(
        read_metrics(out / "one" / "metrics.jsonl", "sft"),
        read_metrics(out / "two" / "metrics.jsonl", "sft"),
        strict=False,
    ):
        worst = max(worst, abs(a["loss"] - b["loss"]), abs(a["grad_norm"] - b["grad_norm"]))
        print(
            f"| {a.get('step')} | {a['loss']:.6f} | {b['loss']:.6f} | {a['grad_norm']:.6f} | {b['grad_norm']:.6f} |"
        )
    print(f"\nlargest |difference|: {worst:.2e}")


def rl_check(out: Path, model: Path, device: str) -> None:
    run = out / "rl"
    config = out / "rl.toml"
    config.write_text(
        f"""
seq_len = 256
max_steps = 3
run_dir = "{run}"
[model]
name = "{model}"
[cluster]
inference_nodes = 1
trainer_nodes = 1
gpus_per_node = {1 if device == "cuda" else 0}
hosts = ["127.0.0.1", "127.0.0.1"]
rdzv_port = {free_port()}
weights_group_port = {free_port()}
[inference]
port = {free_port()}
[orchestrator]
batch_size = 32
group_size = 4
[orchestrator.sampling]
max_tokens = 32
"""
    )
    start = time.monotonic()
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "tandem.launch.node", "@", str(config), "--node", str(k)],
            env={**ENV, **gpu(device, k)},
        )
        for k in range(2)
    ]
    codes = [p.wait(timeout=900) for p in launchers]
    published = (run / "weights" / "step_3" / "STABLE").is_file()
    print("\n## RL, two node launchers (inference node on GPU 0, trainer node on GPU 1)\n")
    print("| exit codes | wall s | weights/step_3 published |\n|---|---|---|")
    print(f"| {codes} | {time.monotonic() - start:.1f} | {published} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/multinode"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    model = build_tiny_model(out=args.out / "model")
    sft_check(args.out, model, args.device)
    rl_check(args.out, model, args.device)


if __name__ == "__main__":
    main()
