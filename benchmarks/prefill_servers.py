"""Prefill on other servers (`[inference.prefill]`) against servers that prefill their own prompts,
on the same devices: real servers on 127.0.0.1, an open-loop stream of long-prompt requests.

Layouts, each given the same devices (CPU cores, or GPUs):
- colocated: S servers, each computing and decoding its own prompts; requests round-robin;
- split-shared, split-p2p, split-http: S − 1 decode servers and one prefill server, whose keys and
  values the decode servers take into their prefix caches (prefill.py), through its staging
  buffers (CUDA IPC, or shared memory on CPU), sent from them over a link per pair (NCCL, gloo on
  CPU; formed during the warm-up) or in HTTP bodies.

The load: requests arrive at a fixed rate (`--rate` per second) for `--duration` seconds, each a
prompt of `--prompt-len` new tokens (no shared prefix) and `--output-len` streamed tokens, sent to
the decode servers only. Per layout: output tok/s over the run, time to first token and the gaps
between streamed tokens (p50 / p99) at the clients, and, for split layouts, how many prompts the
prefill server computed and the seconds they waited for it. A decode step that shares its device with a
prefill chunk waits for it, which shows in the gaps' tail; that tail is what disaggregation is for.

    uv run python benchmarks/prefill_servers.py                    # CPU: 2 servers, a core each
    python benchmarks/prefill_servers.py --gpus 0,1 --shape qwen3-0.6b --prompt-len 2048 \\
        --output-len 256 --rate 8 --layouts colocated split-shared split-p2p split-http   # two GPUs
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from http_load import RequestTiming, streamed_request  # noqa: E402
from inference_throughput import percentile  # noqa: E402

from tandem.net import free_port  # noqa: E402

CPU_SHAPE = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
             "intermediate_size": 768}  # fmt: skip


def scrape(port: int) -> dict[str, float]:
    """Every unlabelled metric the server exports (GET /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = (line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in values if "{" not in name}


def build(args: argparse.Namespace) -> Path:
    out = args.work_dir / (args.shape or "cpu-small")
    if (out / "config.json").exists():
        return out
    if args.shape:
        import torch
        from bench_models import build_random

        return build_random(args.shape, out, torch.device("cuda"))
    from tandem.models.tiny import build_tiny_model

    return build_tiny_model(out=out, max_position_embeddings=4096, **CPU_SHAPE)


def start(
    args: argparse.Namespace, model: Path, device: str, extra: list[str], log: Path
) -> tuple[subprocess.Popen, int]:
    """A server on `device` (a GPU id, or a count of CPU threads as "cpu:N"); returns once /health answers."""
    port = free_port()
    env = dict(os.environ)
    if device.startswith("cpu:"):
        env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": device[4:]}
    else:
        env["CUDA_VISIBLE_DEVICES"] = device
    command = [
        sys.executable, "-m", "tandem.inference.cli", "--model.name", str(model), "--port", str(port),
        "--log-level", "warning", "--stream-interval-s", "0",
        "--engine.max-model-len", str(args.prompt_len + args.output_len + 64), *extra,
    ]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process, port
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"a server did not start on {device}:\n{log.read_text()[-3000:]}")


async def load(ports: list[int], args: argparse.Namespace, seed: int) -> tuple[list[RequestTiming], float]:
    """The open-loop stream of requests, round-robin over `ports`; their timings and the wall time."""
    rng = random.Random(seed)
    count = max(1, round(args.rate * args.duration))
    bodies = [
        json.dumps({
            "prompt": [rng.randrange(3, 300) for _ in range(args.prompt_len)], "max_tokens": args.output_len,
            "ignore_eos": True, "stream": True, "return_token_ids": True, "temperature": 1.0,
        }).encode()
        for _ in range(count)
    ]  # fmt: skip
    timings = [RequestTiming(0.0) for _ in bodies]
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
        start = time.monotonic()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
            timings[i].sent = time.monotonic()
            url = f"http://127.0.0.1:{ports[i % len(ports)]}/v1/completions"
            await streamed_request(client, url, bodies[i], timings[i])

        await asyncio.gather(*(one(i) for i in range(count)))
        return timings, time.monotonic() - start


def measure(args: argparse.Namespace, model: Path, layout: str) -> dict:
    devices = args.gpus.split(",") if args.gpus else [f"cpu:{args.threads}"] * args.servers
    servers = []
    try:
        if layout.startswith("split-"):
            prefill, prefill_port = start(
                args, model, devices[-1], [], args.work_dir / f"{layout}-prefill.log"
            )
            servers.append(prefill)
            url = json.dumps([f"http://127.0.0.1:{prefill_port}"])
            transport = layout.removeprefix("split-")
            extra = ["--prefill.servers", url, "--prefill.min-tokens", str(args.min_tokens)]
            extra += ["--prefill.transport", transport]
            decode_devices = devices[:-1]
            if transport == "shared" and args.gpus:  # (CUDA IPC: the prefill server's GPU visible too)
                decode_devices = [f"{d},{devices[-1]}" for d in decode_devices]
        else:
            extra, decode_devices = [], devices
        ports = []
        for k, device in enumerate(decode_devices):
            process, port = start(args, model, device, extra, args.work_dir / f"{layout}-{k}.log")
            servers.append(process)
            ports.append(port)
        asyncio.run(
            load(ports, argparse.Namespace(**{**vars(args), "duration": 2 / args.rate}), seed=1)
        )  # warm-up
        before = [scrape(port) for port in ports]
        timings, wall = asyncio.run(load(ports, args, seed=2))
        after = [scrape(port) for port in ports]
    finally:
        for process in servers:
            process.terminate()
        for process in servers:
            process.wait(timeout=60)

    def grown(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))

    gaps = [g for t in timings for g in t.gaps()]
    ttft = [t.first_token() - t.sent for t in timings]
    return {
        "layout": layout,
        "servers": len(devices),
        "requests": len(timings),
        "tok_per_s": sum(t.tokens for t in timings) / wall,
        "ttft_ms": [1e3 * statistics.median(ttft), 1e3 * percentile(ttft, 99)],
        "gap_ms": [1e3 * statistics.median(gaps), 1e3 * percentile(gaps, 99)],
        "prefilled_remotely": grown("tandem_prefill_remote_prompts_total"),
        "remote_failures": grown("tandem_prefill_remote_failures_total"),
        "remote_wait_s": grown("tandem_prefill_remote_seconds_total"),
        "prompt_tokens_computed": grown("tandem_prefill_tokens_computed_total"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", help="GPU ids, e.g. 0,1 (default: CPU servers)")
    parser.add_argument("--servers", type=int, default=2, help="CPU: servers (each --threads cores)")
    parser.add_argument("--threads", type=int, default=1, help="CPU: threads per server")
    parser.add_argument("--shape", choices=["qwen3-0.6b", "qwen3-8b"], help="GPU model shape (random init)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--min-tokens", type=int, default=64, help="prefill.min_tokens of the decode servers")
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=["colocated", "split-shared", "split-p2p", "split-http"],
        default=["colocated", "split-shared", "colocated", "split-shared"],
    )
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-prefill-servers"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = build(args)
    rows = []
    print(
        "| layout | servers | requests | output tok/s | TTFT p50 / p99 ms | token gap p50 / p99 ms | "
        "prompts prefilled elsewhere (failed) | waited s | prompt tokens computed by decode servers |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        r = measure(args, model, layout)
        rows.append(r)
        print(
            f"| {layout} | {r['servers']} | {r['requests']} | {r['tok_per_s']:,.0f} | "
            f"{r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} | {r['gap_ms'][0]:.1f} / {r['gap_ms'][1]:.1f} | "
            f"{r['prefilled_remotely']:.0f} ({r['remote_failures']:.0f}) | {r['remote_wait_s']:.1f} | "
            f"{r['prompt_tokens_computed']:,.0f} |",
            flush=True,
        )
    if args.out:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
