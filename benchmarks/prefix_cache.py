"""What the prefix cache saves where prompts share prefixes: prefill tokens computed (the server's
`tandem_prefill_tokens_computed_total`), with the cache on and off, on three workloads:

- n = 8 samples of one prompt in one request (prefilled once either way: the samples fork);
- the same 8 samples as 8 requests sent together (what a client that does not use `n` sends);
- multi-turn Wordle rollouts (`evaluate --env.name wordle`: every turn re-sends the conversation).

The counts depend on what the engine computes, not on how fast: they are the same on a CPU as
on a GPU (seconds are printed too, for this machine). A real server on 127.0.0.1 each time.

    uv run python benchmarks/prefix_cache.py                   # CPU: tiny model, ~1 minute
"""

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tandem.models.tiny import build_tiny_model
from tandem.net import free_port


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("tandem_")
    }


def serve(model: Path, cached: bool, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tandem.inference.cli", "--model", str(model), "--port", str(port),
               "--engine.prefix-caching", str(cached).lower(), "--engine.max-model-len", "1024",
               "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server did not start (log: {log})")
        time.sleep(0.3)


async def samples(url: str, prompt: list[int], n: int, requests: int) -> None:
    body = {"prompt": prompt, "max_tokens": 16, "n": n, "temperature": 1.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(requests))
        )
    for r in responses:
        r.raise_for_status()


def run_eval(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=1200)


def measure(url: str, fn: Callable, arg: object) -> dict:
    before = counters(url)
    start = time.perf_counter()
    fn(arg)
    after = counters(url)
    return {
        "prefill_tokens_computed": after["tandem_prefill_tokens_computed_total"]
        - before["tandem_prefill_tokens_computed_total"],
        "prompt_tokens": after["tandem_prompt_tokens_total"] - before["tandem_prompt_tokens_total"],
        "prefix_cache_hit_tokens": after["tandem_prefix_cache_hit_tokens_total"]
        - before["tandem_prefix_cache_hit_tokens_total"],
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="default: a tiny random Qwen3")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--wordle-tasks", type=int, default=16)
    parser.add_argument("--wordle-n", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-prefix-bench")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or build_tiny_model(out=args.work_dir / "tiny")
    prompt = [(7 * i) % 300 + 3 for i in range(args.prompt_len)]
    results: dict[str, dict] = {}
    for cached in (False, True):
        label = "on" if cached else "off"
        server, url = serve(model, cached, args.work_dir / f"server-{label}.log")
        try:
            other = prompt[::-1]  # (shares nothing with the prompt above)
            eval_cmd = [sys.executable, "-m", "tandem.evaluate", "--server", url, "--model.name", str(model),
                        "--env.name", "wordle", "--num-tasks", str(args.wordle_tasks), "--n", str(args.wordle_n),
                        "--sampling.temperature", "1", "--sampling.max-tokens", "8", "--seq-len", "1024"]  # fmt: skip
            workloads = {
                "n=8 in one request": (asyncio.run, samples(url, prompt, 8, 1)),
                "8 requests of one prompt": (asyncio.run, samples(url, other, 1, 8)),
                "wordle rollouts": (run_eval, eval_cmd),
            }
            for workload, (fn, arg) in workloads.items():
                results[f"{workload}, cache {label}"] = measure(url, fn, arg)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"\nprefill tokens computed (model {model}; prompt {args.prompt_len} tokens; "
          f"wordle {args.wordle_tasks} tasks × {args.wordle_n})")  # fmt: skip
    print(
        "| workload | prompt tokens | computed, cache off | computed, cache on | saved | seconds off / on |"
    )
    print("|---|---|---|---|---|---|")
    for workload in ("n=8 in one request", "8 requests of one prompt", "wordle rollouts"):
        off, on = results[f"{workload}, cache off"], results[f"{workload}, cache on"]
        ratio = off["prefill_tokens_computed"] / max(on["prefill_tokens_computed"], 1)
        print(f"| {workload} | {on['prompt_tokens']:.0f} | {off['prefill_tokens_computed']:.0f} | "
              f"{on['prefill_tokens_computed']:.0f} | {ratio:.2f}× | {off['seconds']:.1f} / {on['seconds']:.1f} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
