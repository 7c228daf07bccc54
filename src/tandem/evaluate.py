"""`uv run evaluate`: evaluate a model on environments' held-out splits through an inference server.

    uv run evaluate --model.name runs/reverse_text/sft/final              # reverse_text, greedy
    uv run evaluate --model.name DIR --env.name wordle --n 8 --sampling.temperature 1.0
    uv run evaluate @ eval.toml --server http://127.0.0.1:8000            # a server already running

Without `server`, a native inference server for `model.name` is started on a free 127.0.0.1
port (settings under [inference]) and stopped at the end. The tasks are played by the rollout
code the orchestrator uses (`orchestrator.evaluation`), `n` times each. Prints a table per
environment (mean reward, every metric's mean, pass@k when n > 1 and the environment has a
binary success metric), then one summary line per environment; `out` gets the numbers and every
task's completions as JSON.
"""

import contextlib
import json
import logging
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from rich.console import Console
from rich.table import Table

from tandem.cli import UserError, run_cli
from tandem.client.config import ClientConfig, SamplingConfig
from tandem.config import ModelConfig, Section, parse_config
from tandem.config.base import base_urls
from tandem.config.loader import to_toml
from tandem.envs.config import EnvConfig, chosen_environments
from tandem.inference.config import InferenceConfig
from tandem.net import free_port

SERVER_MODULE = "tandem.inference.cli"
GENERIC_STATS = (
    "reward_std",
    "completion_len_mean",
    "completion_len_max",
    "prompt_len_mean",
    "truncated_frac",
    "num_samples",
)
"""Per-environment numbers that are not the environment's own metrics."""


class EvalSamplingConfig(SamplingConfig):
    """How evaluation rollouts are sampled: greedy by default."""

    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0 = greedy (then n must be 1).")
    max_tokens: int = Field(32, gt=0, description="Most tokens one model turn may generate.")


class EvalConfig(Section):
    model: ModelConfig = Field(
        ModelConfig(), description="The model to evaluate (served when `server` is not set)."
    )
    env: EnvConfig = EnvConfig()
    envs: list[EnvConfig] = Field(
        [], description="Several environments ([[envs]] tables with [env]'s keys); replaces [env]."
    )
    num_tasks: int = Field(
        200, gt=0, description="Held-out tasks per environment (the first N of its split)."
    )
    n: int = Field(1, gt=0, description="Rollouts per task; pass@k is reported for k <= n when n > 1.")
    sampling: EvalSamplingConfig = EvalSamplingConfig()
    seq_len: int = Field(
        2048, gt=0, description="Most tokens of one sample; also the started server's context length."
    )
    rollout_timeout: float = Field(900.0, gt=0, description="Seconds one task's rollouts may take.")
    server: str | None = Field(
        None, description="Base URL of a running inference server; default: start one."
    )
    inference: InferenceConfig = Field(
        InferenceConfig(),
        description="The server started when `server` is not set (its port is chosen free).",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="How long the started server may take to start."
    )
    client: ClientConfig = ClientConfig()
    out: Path | None = Field(None, description="Write the results and every completion as JSON here.")

    @field_validator("server")
    @classmethod
    def _base_url(cls, url: str | None) -> str | None:
        return url if url is None else base_urls([url])[0]

    @model_validator(mode="after")
    def check(self) -> "EvalConfig":
        chosen_environments(self.env, self.envs)
        if self.n > 1 and self.sampling.temperature == 0:
            raise PydanticCustomError(
                "shape", "n > 1 needs sampling.temperature > 0 (greedy samples are identical)"
            )
        served = self.inference.model.name
        if served and self.model.name and served != self.model.name:
            raise PydanticCustomError(
                "shape",
                f"inference.model.name ({served}) differs from model.name ({self.model.name}): the server "
                "and the prompts' tokenizer take one model; set model.name only",
            )
        if self.seq_len <= self.sampling.max_tokens:
            raise PydanticCustomError(
                "shape",
                f"seq_len ({self.seq_len}) must exceed sampling.max_tokens ({self.sampling.max_tokens})",
            )
        max_n = self.inference.engine.max_n
        if self.server is None and self.inference.backend != "vllm" and self.n > max_n:
            raise PydanticCustomError(
                "shape",
                f"n ({self.n}) exceeds inference.engine.max_n ({max_n}), the most samples the started "
                "server gives one request: raise inference.engine.max_n",
            )
        return self

    @classmethod
    def effective_defaults(cls) -> "EvalConfig":
        """The defaults `--help` and the config reference show (tandem.config.fields): the started
        server's section as evaluate fills it in (its context length is seq_len)."""
        cfg = cls()
        return cfg.model_copy(update={"inference": server_section(cfg)})


def server_section(cfg: EvalConfig) -> InferenceConfig:
    """The started server's section but its address: [inference] serving `model` (unless it names
    its own), with seq_len as its context length (unless it sets one)."""
    engine = {"max_model_len": cfg.inference.engine.max_model_len or cfg.seq_len}
    return cfg.inference.model_copy(
        update={
            "model": cfg.inference.model if cfg.inference.model.name else cfg.model,
            "engine": cfg.inference.engine.model_copy(update=engine),
        }
    )


@contextlib.contextmanager
def inference_server(cfg: EvalConfig, scratch: Path) -> Iterator[str]:
    """`cfg.server`, or a native server for `cfg.model` started in a subprocess until the block ends."""
    if cfg.server:
        yield cfg.server.rstrip("/")
        return
    port = free_port()
    server_cfg = server_section(cfg).model_copy(update={"host": "127.0.0.1", "port": port})
    (scratch / "inference.toml").write_text(to_toml(server_cfg))
    log_path = scratch / "inference.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULE, "@", str(scratch / "inference.toml")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                what = (
                    f"exited with {process.returncode}"
                    if process.poll() is not None
                    else "did not start in time"
                )
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise UserError(f"the inference server for {cfg.model.name} {what}: {tail[0]}")
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def evaluate(cfg: EvalConfig) -> dict:
    """Run the evaluation; returns what `out` gets (summary per environment, stats, tasks)."""
    from tandem.envs.mixture import load_mixture, split_tasks

    members = load_mixture(cfg.env, cfg.envs)  # a wrong name fails before torch loads
    for member in members:
        split_tasks(member, "eval")
    from tandem.client.inference import ServerPool
    from tandem.models.loading import load_tokenizer
    from tandem.models.source import check_local_checkpoint, check_model_source
    from tandem.orchestrator.cli import run_async
    from tandem.orchestrator.evaluation import eval_stats, run_eval
    from tandem.orchestrator.watchdog import watch_event_loop

    check_model_source(cfg.model.name)
    check_local_checkpoint(cfg.model.name, weights=cfg.server is None)  # (a server of its own: the tokenizer)
    tokenizer = load_tokenizer(cfg.model.name)
    for member in members:
        member.env.setup(tokenizer, cfg.seq_len)

    async def play(url: str) -> tuple[list, float]:
        pool = ServerPool([url], cfg.client)
        try:
            async with watch_event_loop():
                await pool.connect(cfg.seq_len)
                start = time.perf_counter()
                results = await run_eval(
                    members, pool, cfg.num_tasks, cfg.sampling, cfg.n, cfg.rollout_timeout, cfg.seq_len
                )
                return results, time.perf_counter() - start
        finally:
            await pool.close()

    with (
        tempfile.TemporaryDirectory(prefix="tandem-eval-") as scratch,
        inference_server(cfg, Path(scratch)) as url,
    ):
        results, seconds = run_async(play(url))
    stats = eval_stats(members, results, cfg.n, prefix="")
    envs = {}
    for m in members:
        key = f"env/{m.name}/"
        values = {k[len(key) :]: v for k, v in stats.items() if k.startswith(key)}
        envs[m.name] = {
            "num_tasks": int(values.pop("num_tasks")),
            "failed": int(values.pop("failed")),
            "reward_mean": values.pop("reward_mean", 0.0),
            "pass_at_k": {k: values.pop(k) for k in list(values) if k.startswith("pass@")},
            "stats": {k: values.pop(k) for k in GENERIC_STATS if k in values},
            "metrics": values,
        }
    return {
        "model": cfg.model.name,
        "server": cfg.server,
        "n": cfg.n,
        "sampling": cfg.sampling.model_dump(),
        "seconds": seconds,
        "envs": envs,
        "tasks": [
            {
                "env": r.env,
                "task_id": r.task_id,
                "error": r.error,
                "samples": [
                    {
                        "reward": t.reward,
                        "metrics": t.metrics,
                        "messages": t.messages,
                        "num_tokens": t.num_tokens,
                    }
                    for t in r.trajectories
                ],
            }
            for r in results
        ],
    }


def print_result(result: dict, console: Console) -> None:
    """A table of every environment, then one plain summary line each (the last line of output
    is the last environment's summary, for scripts)."""
    envs = result["envs"]
    metrics = sorted({m for e in envs.values() for m in e["metrics"]})
    ks = sorted({k for e in envs.values() for k in e["pass_at_k"]}, key=lambda k: int(k[5:]))
    sampling = result["sampling"]
    table = Table(title=f"{result['model']}: n={result['n']}, temperature {sampling['temperature']:g}")
    for column in ["env", "tasks", "failed", "reward", *metrics, *ks, "completion len"]:
        table.add_column(column, justify="left" if column == "env" else "right", no_wrap=column == "env")
    for name, e in envs.items():
        cells = [name, str(e["num_tasks"]), str(e["failed"]), f"{e['reward_mean']:.4f}"]
        cells += [f"{e['metrics'][m]:.4f}" if m in e["metrics"] else "-" for m in metrics]
        cells += [f"{e['pass_at_k'][k]:.4f}" if k in e["pass_at_k"] else "-" for k in ks]
        cells.append(f"{e['stats'].get('completion_len_mean', 0.0):.1f}")
        table.add_row(*cells)
    console.print(table)
    for name, e in envs.items():
        parts = [f"mean reward {e['reward_mean']:.4f}"]
        parts += [f"{m} {v:.4f}" for m, v in e["metrics"].items()]
        parts += [f"{k} {v:.4f}" for k, v in e["pass_at_k"].items()]
        failed = f" ({e['failed']} failed: not in the means)" if e["failed"] else ""
        print(
            f"{name}: {e['num_tasks']} held-out tasks{failed}, "
            + ", ".join(parts)
            + f" ({result['seconds']:.1f}s)"
        )


def check_out(out: Path) -> None:
    """`out` can be written (before anything starts: a finished run must not be lost to it)."""
    if out.is_dir():
        raise UserError(f"out: {out} is a directory; give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"out: cannot create {out.parent} ({e.strerror})") from None


def write_out(out: Path, result: dict) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)


def stop_on_sigterm(*_: object) -> None:
    """SIGTERM (timeout, a batch system) ends the run as Ctrl-C does: the server is stopped."""
    raise SystemExit(128 + signal.SIGTERM)


def main() -> None:
    def run() -> None:
        cfg = parse_config(EvalConfig, prog="evaluate")
        logging.basicConfig(
            level=logging.WARNING, format="eval: %(levelname)s %(message)s", stream=sys.stderr
        )
        if not cfg.model.name:
            raise UserError("model.name is required, e.g. --model.name runs/reverse_text/sft/final")
        if cfg.out:
            check_out(cfg.out)
        signal.signal(signal.SIGTERM, stop_on_sigterm)
        result = evaluate(cfg)
        if cfg.out:
            write_out(cfg.out, result)
        console = Console()
        print_result(result, console if console.is_terminal else Console(width=200))  # no cut columns in logs

    run_cli(run, "evaluate")


if __name__ == "__main__":
    main()
