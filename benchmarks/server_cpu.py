"""The inference server's own CPU time per request on CPU: its event loop's (the thread that reads
requests, tokenizes, formats and sends responses) and the whole process's, per whole request or
per streamed token, with the servers of several source trees measured round by round in turn.

The model is engine_step_host.py's (1 layer, width 32, vocabulary 512): the engine's compute is
negligible and the server's own work shows. Each tree's server is a process of its own (`--src`
picks its source tree, so old and new code are measured in one run, alternating); a round sends
N concurrent requests of P random prompt token ids for O tokens each (EOS ignored) to each
server in turn, and reads the server's CPU time from Linux /proc before and after. The table
shows each tree's median and best round. On a machine shared with other jobs only trees
measured in the same run compare.

    uv run python benchmarks/server_cpu.py                                   # this tree
    git archive HEAD~3 src | tar -x -C /tmp/base                             # an older tree
    uv run python benchmarks/server_cpu.py --src /tmp/base/src --src src     # old vs new
    uv run python benchmarks/server_cpu.py --stream --num-requests 64 --output-len 128
    uv run python benchmarks/server_cpu.py -- --engine.core-process true     # server arguments
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
from engine_step_host import build_model  # noqa: E402
from http_load import Connection  # noqa: E402
from inference_throughput import process_cpu_seconds  # noqa: E402

from tandem.net import free_port  # noqa: E402


def loop_cpu_seconds(pid: int) -> float:
    """CPU time so far of the server's main thread (its event loop), in nanoseconds' resolution
    (/proc's schedstat; its stat counts 10 ms ticks)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


def start_server(src: Path, model: Path, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    """A server running the code of `src`; returns once /health answers."""
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "tandem.inference.cli", "--model.name", str(model), "--model.dtype", "float32",
        "--port", str(port), "--log-level", "warning", "--engine.max-num-seqs", str(args.num_requests),
        "--engine.max-model-len", str(args.prompt_len + args.output_len + 64), *args.server_args,
    ]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server of {src} did not start:\n{log.read_text()[-3000:]}")


async def send_round(
    client: httpx.AsyncClient, connections: list[Connection], port: int, bodies: list[bytes], stream: bool
) -> None:
    """All requests at once (whole ones on `connections`, one each); checks every response's tokens."""

    async def whole(connection: Connection, body: bytes) -> int:
        _, content = await connection.post("/v1/completions", body)
        return len(json.loads(content)["choices"][0]["token_ids"])

    async def streamed(body: bytes) -> int:
        tokens = 0
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with client.stream(
            "POST", url, content=body, headers={"content-type": "application/json"}
        ) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens += sum(len(c["token_ids"]) for c in json.loads(line[6:])["choices"])
        return tokens

    if stream:
        counts = await asyncio.gather(*(streamed(body) for body in bodies))
    else:
        counts = await asyncio.gather(*(whole(c, body) for c, body in zip(connections, bodies, strict=True)))
    expected = json.loads(bodies[0])["max_tokens"]
    if any(count != expected for count in counts):
        raise RuntimeError(f"got {counts} tokens, expected {expected} each")


def bodies(rng: random.Random, args: argparse.Namespace) -> list[bytes]:
    """New prompts (ids the tokenizer knows) for a round, encoded before the round starts."""
    body = {
        "max_tokens": args.output_len,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": args.stream,
    }
    return [
        json.dumps({**body, "prompt": [rng.randrange(3, 320) for _ in range(args.prompt_len)]}).encode()
        for _ in range(args.num_requests)
    ]


async def measure(servers: list[tuple[Path, subprocess.Popen, int]], args: argparse.Namespace) -> dict:
    """Warm-up, then `--rounds` rounds over the servers in turn: CPU seconds per round and server.
    The client is light (plain keep-alive connections for whole responses: httpx would spend
    several times the server's CPU on each request, on the same cores)."""
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=args.num_requests, max_keepalive_connections=args.num_requests)
    spent: dict[Path, list[tuple[float, float]]] = {src: [] for src, _, _ in servers}
    connections = {
        port: await asyncio.gather(*(Connection.open(port) for _ in range(args.num_requests)))
        for _, _, port in servers
    }
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for _, _, port in servers:
            await send_round(client, connections[port], port, bodies(rng, args), args.stream)
        for _ in range(args.rounds):
            for src, server, port in servers:
                load = bodies(rng, args)
                before = process_cpu_seconds(server.pid)[0], loop_cpu_seconds(server.pid)
                await send_round(client, connections[port], port, load, args.stream)
                after = process_cpu_seconds(server.pid)[0], loop_cpu_seconds(server.pid)
                spent[src].append((after[0] - before[0], after[1] - before[1]))
    for connection in (c for cs in connections.values() for c in cs):
        connection.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", type=Path, action="append", help="source tree(s) to measure (default: src)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="streamed responses (CPU per token)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-server-cpu")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("server_args", nargs="*", help="extra `inference` arguments, after --")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work_dir / "model")
    srcs = args.src or [Path(__file__).resolve().parent.parent / "src"]
    servers = []
    try:
        for k, src in enumerate(srcs):
            port = free_port()
            servers.append(
                (src, start_server(src, model, port, args, args.work_dir / f"server-{k}.log"), port)
            )
        spent = asyncio.run(measure(servers, args))
    finally:
        for _, server, _ in servers:
            server.terminate()
            server.wait(timeout=60)
    unit, count = (
        ("token", args.num_requests * args.output_len) if args.stream else ("request", args.num_requests)
    )
    print(
        f"\nserver CPU µs per {unit}: {args.num_requests} {'streamed' if args.stream else 'whole'} requests of "
        f"{args.prompt_len} prompt + {args.output_len} output tokens, {args.rounds} rounds"
    )
    print(f"| {'source':<40} | event loop, median (best) | rounds | whole process, median |")
    print(f"|{'-' * 42}|---|---|---|")
    rows = []
    for src, rounds in spent.items():
        loop = [1e6 * r[1] / count for r in rounds]
        total = [1e6 * r[0] / count for r in rounds]
        shown = " / ".join(f"{x:.0f}" if not args.stream else f"{x:.1f}" for x in loop)
        print(
            f"| {str(src):<40} | {statistics.median(loop):8.1f} ({min(loop):.1f}) | {shown} | "
            f"{statistics.median(total):.1f} |"
        )
        rows.append({"src": str(src), "unit": unit, "event_loop_us": loop, "process_us": total})
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
