"""Where a GPU sat idle in a torch.profiler trace, and what the host was doing then.

Shared by trainer_mfu.py (`--profile`) and engine_throughput.py (`--timeline`). Both take the
chrome trace that `profile.export_chrome_trace` writes (`trace_of` does that for a finished
profiler) and count the GPU busy where any kernel, copy or memset runs.
"""

import json
import tempfile
from pathlib import Path


def trace_of(prof: object) -> dict:
    """The chrome trace of a finished torch.profiler `profile`, as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")  # type: ignore[attr-defined]
        return json.loads(Path(f"{tmp}/trace.json").read_text())


def _events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _gpu_spans(events: list[dict]) -> list[tuple[float, float, str]]:
    return sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )


def gpu_idle(trace: dict, top: int = 12) -> str:
    """The GPU's busy time (the union of its kernels and copies) against the span from the first
    to the last, and the longest idle gaps, each with the host operators open when it began (what
    the host was doing while the GPU ran dry) and the kernel that ended it."""
    events = _events(trace)
    gpu = _gpu_spans(events)
    if not gpu:
        return "no GPU events"
    busy, gaps, end = 0.0, [], gpu[0][0]
    for begin, finish, kernel in gpu:
        if begin > end:
            gaps.append((begin - end, end, kernel))
        busy += max(0.0, finish - max(begin, end))
        end = max(end, finish)
    span = end - gpu[0][0]
    host = [
        e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function")
    ]
    lines = [f"GPU busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms ({100 * busy / span:.1f} %); "
             f"idle {sum(g[0] for g in gaps) / 1e3:.1f} ms in {len(gaps)} gaps, the longest (host operators "
             "open when it began; the kernel that ended it):"]  # fmt: skip
    for gap, at, kernel in sorted(gaps, reverse=True)[:top]:
        open_ops = sorted((e for e in host if e["ts"] <= at <= e["ts"] + e["dur"]), key=lambda e: e["dur"])
        names = " < ".join(e["name"][:50] for e in open_ops[:4]) or "(no host operator)"
        lines.append(f"  {gap / 1e3:7.3f} ms at {(at - gpu[0][0]) / 1e3:8.2f} ms: {names} -> {kernel[:50]}")
    return "\n".join(lines)


def busy_by_window(trace: dict, windows: int = 10) -> str:
    """The GPU's busy share in each of `windows` equal slices of the span from its first to its
    last event: whether idle time sits at the ends (ramp-up, tail) or in every step."""
    gpu = _gpu_spans(_events(trace))
    if not gpu:
        return "no GPU events"
    first, last = gpu[0][0], max(end for _, end, _ in gpu)
    width = (last - first) / windows
    busy = [0.0] * windows
    for begin, end, _ in gpu:  # overlapping kernels (several streams) may count twice: clipped below
        for w in range(int((begin - first) // width), min(windows, int((end - first) // width) + 1)):
            lo, hi = first + w * width, first + (w + 1) * width
            busy[w] += max(0.0, min(end, hi) - max(begin, lo))
    shares = " ".join(f"{min(100.0, 100 * b / width):.0f}%" for b in busy)
    return f"GPU busy in each of {windows} slices of the {(last - first) / 1e3:.1f} ms span: {shares}"
