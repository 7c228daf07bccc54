"""Weight sync: from "optimizer step done" to "the server answers with the new version", per
transport, for Qwen3-0.6B- and 1.7B-shaped models (random init), side by side in one run.

    PYTHONPATH=src python3 benchmarks/weight_sync.py                       # one or two GPUs
    uv run python benchmarks/weight_sync.py --device cpu --shapes tiny     # a CPU smoke run

This process is the trainer (the real RL trainer's model setup: fp32 weights sharded by FSDP2,
bf16 compute, AdamW, and its PolicyPublisher) and the orchestrator (the real PolicySync, polling
every --poll-ms); the servers are real `inference` processes. One update: a training step on a
random batch, then the clock starts; the trainer publishes the new version (filesystem: writes
weights/step_N; in memory: offers it and streams it once the servers join), the orchestrator sees
it and POSTs /update_weights (the server pauses between two engine steps, receives or loads,
resumes), and the clock stops when that request answers with the new version. Columns:

    notice ms   step done → the orchestrator sees the version (filesystem: the whole disk write)
    update ms   the /update_weights request: pause + transfer + load + resume
    total ms    their sum, median over --updates (first update of each transport not counted)

Servers: one on GPU 0 beside the trainer, receiving by `colocated` (CUDA IPC) and also loading the
filesystem versions; with a second GPU, one on GPU 1 receiving by `broadcast` (NCCL; two processes
on one GPU cannot join an NCCL group, so one GPU has no broadcast row). On CPU: shared memory and
gloo. --busy N keeps N streaming requests running on each server while it updates.
"""

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from tandem.client.config import ClientConfig  # noqa: E402
from tandem.client.inference import ServerPool  # noqa: E402
from tandem.config import build_config  # noqa: E402
from tandem.models.loading import save_model  # noqa: E402
from tandem.models.tiny import QWEN3_0_6B_SHAPE, TinyModelConfig, tiny_qwen3_config  # noqa: E402
from tandem.models.tokenizer import train_tokenizer  # noqa: E402
from tandem.net import free_port  # noqa: E402
from tandem.orchestrator.weights import PolicySync  # noqa: E402
from tandem.trainer.model import build_trainer_model  # noqa: E402
from tandem.trainer.optim import build_optimizer  # noqa: E402
from tandem.trainer.parallel import init_distributed, shutdown  # noqa: E402
from tandem.trainer.rl.config import RLTrainerConfig  # noqa: E402
from tandem.trainer.weight_publisher import PolicyPublisher  # noqa: E402
from tandem.transport.config import WeightsConfig  # noqa: E402

QWEN3_1_7B_SHAPE = {**QWEN3_0_6B_SHAPE, "hidden_size": 2048, "intermediate_size": 6144}
"""Qwen3-1.7B's shape: Qwen3-0.6B's with a wider residual stream and MLP (28 layers, 16/8 heads of 128)."""
SHAPES = {
    "tiny": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768, "vocab_size": 4096},
    "0.6b": QWEN3_0_6B_SHAPE,
    "1.7b": QWEN3_1_7B_SHAPE,
}
TARGET_MS = {("0.6b", "colocated"): 50, ("1.7b", "colocated"): 150}
"""Issue 10's targets on one H200 with trainer and server colocated."""
BATCH_TOKENS = 256


def build_model(shape: str, out: Path, device: torch.device) -> Path:
    """A random-init Qwen3 of `shape` in bf16 (initialised on `device`: fast on a GPU)."""
    cfg = TinyModelConfig(out=out, **SHAPES[shape])
    tokenizer = train_tokenizer()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(tiny_qwen3_config(cfg, len(tokenizer), tokenizer.eos_token_id, 0))
    save_model(model.to(torch.bfloat16), tokenizer, out)
    del model
    return out


@dataclass
class Server:
    """An `inference` process receiving weights by `transport` through the link at `link_port`."""

    name: str
    url: str
    process: subprocess.Popen
    log: Path

    @classmethod
    def start(
        cls, name: str, model: Path, gpu: str | None, transport: str, link_port: int, work: Path, dtype: str
    ):
        port = free_port()
        command = [
            sys.executable, "-m", "tandem.inference.cli",
            "--model.name", str(model), "--model.dtype", dtype, "--port", str(port),
            "--log-level", "warning", "--run-dir", str(work / "fs"),
            "--engine.max-num-seqs", "64", "--engine.max-model-len", "1024", "--engine.kv-cache-memory-gb", "2",
            "--weights.transport", transport, "--weights.port", str(link_port),
            "--weights.transfer-timeout-s", "120",
        ]  # fmt: skip
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        log = work / f"{name}.log"
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        return cls(name, f"http://127.0.0.1:{port}", process, log)

    def wait_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not answer /health within {timeout_s:g} s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Trainer:
    """The RL trainer's model, optimizer and one step on a random batch (weights change every step)."""

    def __init__(self, model: Path, device: str, run_dir: Path, overrides: tuple = ()) -> None:
        self.world = init_distributed(device)
        self.cfg = build_config(
            RLTrainerConfig,
            overrides=[
                ("model.name", str(model)),
                ("model.device", device),
                ("run_dir", str(run_dir)),
                *overrides,
            ],
        )
        self.model = build_trainer_model(
            self.cfg.model, self.world, self.cfg.parallel, lora=self.cfg.lora, seed=self.cfg.seed
        )
        self.optimizer = build_optimizer(self.model, self.cfg.optim)
        self.vocab = self.model.hf_config.vocab_size

    def step(self, rows: int = 1, tokens: int = BATCH_TOKENS) -> None:
        """One optimizer step on random token ids (a stand-in loss: the mean logprob)."""
        ids = torch.randint(0, self.vocab, (rows, tokens), device=self.world.device)
        positions = torch.arange(tokens, device=self.world.device).expand(rows, tokens)
        logprobs, _ = self.model.sequence_logprobs(ids, positions)
        loss = -logprobs.mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.world.device.type == "cuda":
            torch.cuda.synchronize()

    def publisher(self, transport: str, link_port: int, run_dir: Path, tokenizer: object) -> PolicyPublisher:
        weights = WeightsConfig(transport=transport, port=link_port, keep=2, transfer_timeout_s=120)
        return PolicyPublisher(weights, run_dir, tokenizer, self.world, max_steps=1 << 30)  # type: ignore[arg-type]

    def close(self) -> None:
        del self.model, self.optimizer
        shutdown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


async def keep_busy(url: str, count: int, stop: asyncio.Event) -> None:
    """`count` streaming completions in flight until `stop`, so updates land between engine steps."""
    body = {"prompt": [5, 9, 14], "max_tokens": 512, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    if stop.is_set():
                        break

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client) for _ in range(count)), return_exceptions=True)


async def measure(
    trainer: Trainer,
    publisher: PolicyPublisher,
    server: Server,
    transport: str,
    run_dir: Path,
    first_version: int,
    updates: int,
    args: argparse.Namespace,
) -> list[dict[str, float]]:
    """`updates` + 1 updates of `server` (the first a warm-up, dropped); their timings."""
    cfg = WeightsConfig(transport=transport, poll_interval=args.poll_ms / 1000)
    pool = ServerPool([server.url], ClientConfig())
    policy = PolicySync(run_dir, pool, cfg, version=first_version - 1)
    stop = asyncio.Event()
    busy = asyncio.ensure_future(keep_busy(server.url, args.busy, stop)) if args.busy else None
    timings = []
    try:
        for version in range(first_version, first_version + updates + 1):
            trainer.step()
            start = time.perf_counter()
            published = asyncio.ensure_future(asyncio.to_thread(publisher.publish, trainer.model, version))
            while (policy.available() or 0) < version:
                if published.done():
                    published.result()  # raises the trainer's error
                await asyncio.sleep(cfg.poll_interval)
            seen = time.perf_counter()
            served = await policy.sync()
            answered = time.perf_counter()
            await published
            if served != version:
                raise RuntimeError(f"{server.name} serves version {served}, expected {version}")
            timings.append({"notice": seen - start, "update": answered - seen, "total": answered - start})
        await check_version(server.url, first_version + updates)
    finally:
        stop.set()
        if busy is not None:
            await busy
        await pool.close()
    return timings[1:]


def timed_updates(
    trainer: "Trainer",
    server: Server,
    transport: str,
    port: int,
    run_dir: Path,
    version: int,
    updates: int,
    args: argparse.Namespace,
    tokenizer: object,
) -> list[dict[str, float]]:
    """`measure` through a fresh PolicyPublisher of `transport` (its link at `port`)."""
    publisher = trainer.publisher(transport, port, run_dir, tokenizer)
    publisher.start(trainer.model, 0)
    try:
        return asyncio.run(measure(trainer, publisher, server, transport, run_dir, version, updates, args))
    finally:
        publisher.close()


async def check_version(url: str, version: int) -> None:
    body = {"prompt": [5, 9, 14], "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as client:
        choice = (await client.post(url + "/v1/completions", json=body)).json()["choices"][0]
    if choice["weight_versions"] != [version]:
        raise RuntimeError(f"{url} answered with versions {choice['weight_versions']}, expected [{version}]")


def bench_shape(shape: str, args: argparse.Namespace, work: Path) -> list[dict]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    two_gpus = cuda and torch.cuda.device_count() >= 2
    model = build_model(shape, work / "model", device)
    links = {"colocated": free_port(), "broadcast": free_port()}
    servers = {
        "colocated": Server.start(
            "colocated", model, "0" if cuda else None, "colocated", links["colocated"], work, dtype
        )
    }
    if two_gpus or not cuda:
        servers["broadcast"] = Server.start(
            "broadcast", model, "1" if cuda else None, "broadcast", links["broadcast"], work, dtype
        )
    rows = []
    trainer = None
    try:
        trainer = Trainer(model, args.device, work / "fs")
        for server in servers.values():
            server.wait_healthy()
        tokenizer = train_tokenizer()
        params = sum(p.numel() for p in trainer.model.parameters())
        plan = [("filesystem", servers["colocated"], work / "fs", free_port(), args.fs_updates)]
        plan += [
            (t, servers[t], work / t, links[t], args.updates)
            for t in ("colocated", "broadcast")
            if t in servers
        ]
        version = 1
        for transport, server, run_dir, port, updates in plan:
            timings = timed_updates(
                trainer, server, transport, port, run_dir, version, updates, args, tokenizer
            )
            version += updates + 1
            rows.append(row(shape, params, transport, timings, dtype))
            print_row(rows[-1], flush=True)
        if not two_gpus and cuda:
            rows.append({"shape": shape, "transport": "broadcast", "note": "n/a: needs a second GPU"})
    finally:
        for server in servers.values():
            server.stop()
        if trainer is not None:
            trainer.close()
    return rows


def row(shape: str, params: int, transport: str, timings: list[dict[str, float]], dtype: str) -> dict:
    ms = {k: [1000 * t[k] for t in timings] for k in ("notice", "update", "total")}
    nbytes = params * (2 if dtype == "bfloat16" else 4)
    total = statistics.median(ms["total"])
    target = TARGET_MS.get((shape, transport))
    return {
        "shape": shape,
        "params (M)": f"{params / 1e6:.0f}",
        "transport": transport,
        "updates": len(timings),
        "notice ms": f"{statistics.median(ms['notice']):.1f}",
        "update ms": f"{statistics.median(ms['update']):.1f}",
        "total ms": f"{total:.1f}",
        "min ms": f"{min(ms['total']):.1f}",
        "GB/s": f"{nbytes / total / 1e6:.1f}",
        "target": f"≤ {target} ms {'ok' if total <= target else 'MISSED'}" if target else "",
    }


COLUMNS = ["shape", "params (M)", "transport", "updates", "notice ms", "update ms", "total ms", "min ms", "GB/s", "target"]  # fmt: skip


def print_row(r: dict, flush: bool = False) -> None:
    if "note" in r:
        print(f"| {r['shape']} | | {r['transport']} | {r['note']} |", flush=flush)
    else:
        print("| " + " | ".join(str(r[c]) for c in COLUMNS) + " |", flush=flush)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="0.6b,1.7b", help=f"Comma-separated, of {', '.join(SHAPES)}.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--updates", type=int, default=5, help="Timed updates per in-memory transport.")
    parser.add_argument("--fs-updates", type=int, default=2, help="Timed updates by the filesystem.")
    parser.add_argument("--poll-ms", type=float, default=2.0, help="The orchestrator's poll interval.")
    parser.add_argument("--busy", type=int, default=0, help="Streaming requests kept running per server.")
    args = parser.parse_args()
    print(
        f"device {args.device}"
        + (
            f" ({torch.cuda.get_device_name()}, {torch.cuda.device_count()} GPU(s))"
            if args.device == "cuda"
            else ""
        )
    )
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"weight_sync_{shape}_") as work:
            rows += bench_shape(shape, args, Path(work))
    print("\nall shapes:")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for r in rows:
        print_row(r)


if __name__ == "__main__":
    main()
