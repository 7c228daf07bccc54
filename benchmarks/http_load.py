"""The HTTP load of the serving benchmarks (inference_throughput.py, server_cpu.py): one client
process's share of a batch of completions, sent together over connections opened before it,
whole responses over plain kept-alive connections and streams through httpx, each request's
times at the client (and, for whole responses, the server's, by the x-tandem-timing header)."""

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

TIMING_HEADER = "x-tandem-timing"  # (tandem.inference.server.TIMING_HEADER: vLLM does not answer it)


@dataclass
class RequestTiming:
    """One request at its client (time.monotonic(), the clock of the server's times on Linux)."""

    sent: float
    token_times: dict[int, list[float]] = field(default_factory=dict)  # choice → arrival of each token
    tokens: int = 0
    received: float = 0.0  # the whole response read
    server: dict[str, float] = field(default_factory=dict)  # a whole response's times in the server

    def first_token(self) -> float:
        return min(times[0] for times in self.token_times.values())

    def gaps(self) -> list[float]:
        return [b - a for times in self.token_times.values() for a, b in zip(times, times[1:], strict=False)]


class Connection:
    """A kept-alive HTTP/1.1 connection for whole responses (the server sends them with a
    Content-Length). httpx spends ~1.6 ms of CPU on a request on a 2-core CPU machine, six times
    the server's own event-loop time per request, and a client process sends its requests one
    after another: this takes ~40 µs."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> "Connection":
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, path: str, body: bytes, timed: bool = False) -> tuple[dict[str, str], bytes]:
        """POST a JSON body (`timed`: asking for the server's times); the response's headers and body."""
        timing = f"{TIMING_HEADER}: 1\r\n" if timed else ""
        head = (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{timing}\r\n"
        )
        self.writer.write(head.encode() + body)
        status, *lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines if line)}
        content = await self.reader.readexactly(int(headers["content-length"]))
        if status.split(" ", 2)[1] != "200":
            raise RuntimeError(f"{status}: {content.decode()[:1000]}")
        return headers, content

    def close(self) -> None:
        self.writer.close()


async def whole_request(connection: Connection, body: bytes, timing: RequestTiming) -> None:
    headers, content = await connection.post("/v1/completions", body, timed=True)
    timing.received = time.monotonic()
    timing.tokens = sum(len(c["token_ids"]) for c in json.loads(content)["choices"])
    if TIMING_HEADER in headers:
        timing.server = {k: float(v) for k, v in (kv.split("=") for kv in headers[TIMING_HEADER].split(";"))}


async def streamed_request(client: httpx.AsyncClient, url: str, body: bytes, timing: RequestTiming) -> None:
    async with client.stream(
        "POST", url, content=body, headers={"content-type": "application/json"}
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            now = time.monotonic()
            for choice in chunk["choices"]:
                count = len(choice.get("token_ids") or [])
                timing.tokens += count
                timing.token_times.setdefault(choice["index"], []).extend([now] * count)


async def send_load(
    port: int, prompts: dict[int, list[int]], args: argparse.Namespace, stream: bool, start_at: float
) -> tuple[list[RequestTiming], float, float]:
    """One client process's share of the requests, all sent at `start_at` (time.monotonic(), the
    same clock in every process) on connections opened before (as a client that keeps them
    alive between batches: the server's time to accept them is not the batch's); returns their
    timings, when the last one ended and the CPU time this process spent on them."""
    bodies = {}
    for i, prompt in prompts.items():
        body = {
            "prompt": prompt,
            "max_tokens": args.output_len,
            "n": args.n,
            "temperature": args.temperature,
            "ignore_eos": True,
            "stream": stream,
            "return_token_ids": True,
        }
        if args.seeded:
            body["seed"] = i
        bodies[i] = json.dumps(body).encode()
    warm = {
        "prompt": next(iter(prompts.values()))[::-1],  # (shares no prefix with the timed prompts)
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    timings = {i: RequestTiming(0.0) for i in prompts}
    if stream:
        url = f"http://127.0.0.1:{port}/v1/completions"
        limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
            health = f"http://127.0.0.1:{port}/health"
            await asyncio.gather(*(client.get(health) for _ in prompts))
            await streamed_request(client, url, json.dumps(warm).encode(), RequestTiming(0.0))
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            cpu = time.process_time()

            async def go(i: int) -> None:
                timings[i].sent = time.monotonic()
                await streamed_request(client, url, bodies[i], timings[i])

            await asyncio.gather(*(go(i) for i in prompts))
            end, cpu = time.monotonic(), time.process_time() - cpu
        return list(timings.values()), end, cpu
    connections = dict(
        zip(prompts, await asyncio.gather(*(Connection.open(port) for _ in prompts)), strict=True)
    )
    try:
        await whole_request(next(iter(connections.values())), json.dumps(warm).encode(), RequestTiming(0.0))
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        cpu = time.process_time()

        async def send(i: int) -> None:
            timings[i].sent = time.monotonic()
            await whole_request(connections[i], bodies[i], timings[i])

        await asyncio.gather(*(send(i) for i in prompts))
        end, cpu = time.monotonic(), time.process_time() - cpu
    finally:
        for connection in connections.values():
            connection.close()
    return list(timings.values()), end, cpu


def client_process(
    port: int, prompts: dict[int, list[int]], args: argparse.Namespace, stream: bool, start_at: float
):
    return asyncio.run(send_load(port, prompts, args, stream, start_at))
