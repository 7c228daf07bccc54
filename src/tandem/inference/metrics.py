"""Prometheus text exposition of the server's state (GET /metrics).

The engine's counters come from `EngineStats`; the generation rate is measured by the server as
tokens reach it, over a sliding window, so a scrape needs no background task. Latencies are
Prometheus histograms (cumulative buckets, sum and count), observed by the HTTP layer.
"""

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from tandem.inference.engine.api import EngineStats


class RateMeter:
    """Events per second over the last `window_s` seconds (shorter while the meter is young)."""

    def __init__(self, window_s: float = 10.0, bucket_s: float = 0.5) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.started = time.monotonic()
        self.buckets: deque[tuple[float, int]] = deque()  # (bucket start, count)

    def add(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        start = now - (now % self.bucket_s)
        if self.buckets and self.buckets[-1][0] == start:
            self.buckets[-1] = (start, self.buckets[-1][1] + count)
        else:
            self.buckets.append((start, count))
        self._drop_old(now)

    def _drop_old(self, now: float) -> None:
        while self.buckets and self.buckets[0][0] < now - self.window_s:
            self.buckets.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._drop_old(now)
        span = min(self.window_s, max(now - self.started, 1e-3))
        return sum(count for _, count in self.buckets) / span


LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Counts of observed values per upper bound (`le`), their sum and count."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, lines: list[str], name: str, help_text: str) -> None:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip([*(f"{b:g}" for b in self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{name}_sum {self.sum:g}", f"{name}_count {self.count}"]


@dataclass
class ServerCounters:
    """What the HTTP layer counts itself."""

    requests_total: int = 0
    requests_failed_total: int = 0
    requests_aborted_total: int = 0
    weight_updates_total: int = 0
    waiting_for_resume: int = 0
    time_to_first_token: Histogram = field(default_factory=Histogram)  # streaming requests
    # prefill on other servers (prefill.py): as the decode server, and as the prefill server
    prefill_remote_prompts_total: int = 0
    prefill_remote_tokens_total: int = 0
    prefill_remote_failures_total: int = 0
    prefill_remote_seconds_total: float = 0.0
    kv_exports_total: int = 0
    kv_exports_staged_total: int = 0
    kv_sends_total: int = 0


def metric(lines: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]


def render_metrics(stats: EngineStats, counters: ServerCounters, tokens_per_s: float) -> str:
    kv_usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    lines: list[str] = []
    metric(lines, "tandem_requests_running", "gauge", "Samples in the engine's running batch.", stats.running)
    metric(lines, "tandem_requests_waiting", "gauge", "Samples queued in the engine.", stats.waiting)
    metric(
        lines,
        "tandem_requests_waiting_for_resume",
        "gauge",
        "HTTP requests held while the server is paused.",
        counters.waiting_for_resume,
    )
    metric(
        lines,
        "tandem_generation_tokens_per_second",
        "gauge",
        "Generated tokens per second over the last 10 s.",
        tokens_per_s,
    )
    metric(
        lines,
        "tandem_generation_tokens_total",
        "counter",
        "Tokens generated since start.",
        stats.generated_tokens_total,
    )
    metric(
        lines, "tandem_prompt_tokens_total", "counter", "Prompt tokens prefilled.", stats.prompt_tokens_total
    )
    metric(lines, "tandem_engine_steps_total", "counter", "Engine steps run.", stats.steps_total)
    name = "tandem_engine_step_seconds_total"
    lines += [f"# HELP {name} Host seconds of the engine's loop by phase.", f"# TYPE {name} counter"]
    lines += [f'{name}{{phase="{phase}"}} {value:g}' for phase, value in stats.step_seconds.items()]
    metric(
        lines,
        "tandem_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens whose keys and values came from the prefix cache.",
        stats.prefix_cache_hit_tokens_total,
    )
    metric(
        lines,
        "tandem_prefill_tokens_computed_total",
        "counter",
        "Prompt tokens whose keys and values were computed (recomputation after preemption included).",
        stats.prefill_tokens_total,
    )
    metric(lines, "tandem_kv_cache_usage", "gauge", "Fraction of KV-cache blocks in use.", kv_usage)
    metric(lines, "tandem_kv_cache_blocks_used", "gauge", "KV-cache blocks in use.", stats.kv_blocks_used)
    metric(lines, "tandem_kv_cache_blocks_total", "gauge", "KV-cache blocks in all.", stats.kv_blocks_total)
    metric(
        lines, "tandem_weight_version", "gauge", "Version of the weights being served.", stats.weight_version
    )
    metric(lines, "tandem_paused", "gauge", "1 while generation is paused.", int(stats.paused))
    metric(
        lines,
        "tandem_http_requests_total",
        "counter",
        "Generation requests received.",
        counters.requests_total,
    )
    metric(
        lines,
        "tandem_http_requests_failed_total",
        "counter",
        "Generation requests answered with an error.",
        counters.requests_failed_total,
    )
    metric(
        lines,
        "tandem_http_requests_aborted_total",
        "counter",
        "Generation requests whose client went away before the end.",
        counters.requests_aborted_total,
    )
    metric(
        lines,
        "tandem_weight_updates_total",
        "counter",
        "Successful weight updates.",
        counters.weight_updates_total,
    )
    for name, help_text, value in (
        ("prompts", "Prompts whose keys and values came from prefill servers.", counters.prefill_remote_prompts_total),
        ("tokens", "Prompt tokens taken into the cache from prefill servers.", counters.prefill_remote_tokens_total),
        ("failures", "Prompts computed here after their prefill server failed.", counters.prefill_remote_failures_total),
        ("seconds", "Seconds prompts waited for prefill servers.", counters.prefill_remote_seconds_total),
    ):  # fmt: skip
        metric(lines, f"tandem_prefill_remote_{name}_total", "counter", help_text, value)
    metric(
        lines,
        "tandem_kv_exports_total",
        "counter",
        "Prompts computed and exported for decode servers (POST /v1/kv/export).",
        counters.kv_exports_total,
    )
    metric(
        lines,
        "tandem_kv_exports_staged_total",
        "counter",
        "Of those, exports handed over through a staging buffer (transport = shared or p2p).",
        counters.kv_exports_staged_total,
    )
    metric(
        lines,
        "tandem_kv_sends_total",
        "counter",
        "Of those, exports sent over a decode server's p2p link (POST /v1/kv/send).",
        counters.kv_sends_total,
    )
    counters.time_to_first_token.render(
        lines,
        "tandem_time_to_first_token_seconds",
        "Streaming requests: from the validated request to its first generated token reaching the HTTP "
        "layer (the clients' time to first token adds connection, parsing and delivery).",
    )
    return "\n".join(lines) + "\n"
