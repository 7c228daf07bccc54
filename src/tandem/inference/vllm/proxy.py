"""tandem's HTTP front for a vLLM server: the same endpoints and semantics as the native server.

Generation requests (`/v1/*`) are forwarded to vLLM as they are (vLLM validates them and answers
its own 4xx in the same error shape), with three additions:
- a request that arrives while the server is paused waits here until /resume (or a 503);
- a `cache_salt` naming the current weight version, so vLLM's prefix cache never serves KV
  computed with older weights to a newer request;
- `weight_versions` on every response, choice and stream chunk: the versions that were live
  while the request ran (vLLM finishes in-flight requests on the new weights, as the native
  engine's `finish_old` mode does).
The admin endpoints are tandem's: /update_weights calls the worker extension through vLLM's
/collective_rpc (loading a directory, or with an in-memory transport receiving `step` N from the
trainer; the worker joins the trainer's weight link when the front starts), /pause and /resume call vLLM's (in-flight requests are kept, not aborted), and
/metrics passes vLLM's metrics through after tandem's own.

Serving LoRA adapters (`vllm.max_lora_rank`), a weight update is an adapter: a PEFT directory, or
one the worker extension wrote from a transfer. It is loaded in place under one adapter name
through vLLM's LoRA API (/v1/load_lora_adapter), and once one is loaded every generation request
is sent to it (its `model` names the adapter; responses name the served model as before).
"""

import asyncio
import json
import logging
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tandem.inference.config import InferenceConfig
from tandem.inference.errors import APIError
from tandem.inference.http import (
    GENERATION_PATHS,
    SSEResponse,
    new_app,
    request_body,
    until_disconnect,
    wait_for_resume,
)
from tandem.inference.metrics import ServerCounters, metric
from tandem.inference.protocol import UpdateWeightsRequest
from tandem.transport.weights import weights_dir

log = logging.getLogger("tandem.inference.vllm")
LOAD_METHOD = "tandem_load_weights"
RECEIVE_METHOD = "tandem_receive_weights"
"""The worker extension's methods (tandem.inference.vllm.worker_extension)."""
ADAPTER_NAME = "tandem-policy"
"""The name of the policy's LoRA adapter in vLLM (every update reloads it in place)."""
VLLM_GAUGES = {
    "tandem_requests_running": "vllm:num_requests_running",
    "tandem_requests_waiting": "vllm:num_requests_waiting",
    "tandem_kv_cache_usage": "vllm:kv_cache_usage_perc",
}
"""tandem's gauge names (as the native server reports them) and the vLLM metrics they come from."""


class WeightVersions:
    """The weight versions served so far, in load order; tells which were live during a request."""

    def __init__(self, initial: int = 0) -> None:
        self.history = [initial]

    @property
    def current(self) -> int:
        return self.history[-1]

    def mark(self) -> int:
        """A position to pass to `since` when the request ends."""
        return len(self.history) - 1

    def since(self, mark: int) -> list[int]:
        return sorted(set(self.history[mark:]))

    def advance(self, version: int) -> None:
        self.history.append(version)


def version_from_path(path: Path) -> int | None:
    """`.../step_12` → 12, the native engine's rule (not imported from it: that module loads torch,
    which the front does not need)."""
    match = re.fullmatch(r"step_(\d+)", path.name)
    return int(match.group(1)) if match else None


def sum_metric(text: str, name: str) -> float:
    """Sum of a metric's samples (over its labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


class VLLMFront:
    """State of the front: the client to vLLM, weight versions, the pause gate and counters."""

    def __init__(self, config: InferenceConfig, upstream: str, upstream_key: str) -> None:
        self.config = config
        self.client = httpx.AsyncClient(
            base_url=upstream,
            headers={"Authorization": f"Bearer {upstream_key}"},
            timeout=httpx.Timeout(config.vllm.request_timeout_s, connect=10),
        )
        self.versions = WeightVersions()
        self.counters = ServerCounters()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.admin_lock = asyncio.Lock()
        self.adapter_loaded = False
        self.served_name = config.served_model_name or config.model.name

    # --- vLLM calls --------------------------------------------------------------------------

    async def call(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        try:
            return await self.client.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.TransportError as e:
            raise APIError(503, f"vLLM is not reachable ({type(e).__name__}: {e})") from None

    async def admin(self, path: str, **kwargs: object) -> httpx.Response:
        response = await self.call("POST", path, timeout=self.config.vllm.admin_timeout_s, **kwargs)
        if response.status_code != 200:
            raise APIError(500, f"vLLM answered {path} with {response.status_code}: {response.text[:500]}")
        return response

    # --- generation ----------------------------------------------------------------------------

    async def wait_until_resumed(self, request: Request) -> None:
        await wait_for_resume(self.resumed, self.counters, self.config.pause_timeout_s, request)

    def salted(self, body: bytes) -> tuple[bytes, bool]:
        """The request body with the weight version in its cache salt, and whether it streams.
        Bodies that are not a JSON object go to vLLM unchanged, for vLLM to refuse."""
        try:
            data = json.loads(body)
        except ValueError:
            return body, False
        if not isinstance(data, dict):
            return body, False
        salt = f"tandem-w{self.versions.current}"
        data["cache_salt"] = f"{data['cache_salt']}-{salt}" if data.get("cache_salt") else salt
        if self.adapter_loaded:
            data["model"] = ADAPTER_NAME
        return json.dumps(data).encode(), bool(data.get("stream"))

    async def generate(self, request: Request) -> Response:
        body = await request_body(request)
        await self.wait_until_resumed(request)
        mark = self.versions.mark()
        body, stream = self.salted(body)
        upstream = self.client.build_request(
            "POST", request.url.path, content=body, headers={"Content-Type": "application/json"}
        )
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.TransportError as e:
            raise APIError(503, f"vLLM is not reachable ({type(e).__name__}: {e})") from None
        if stream and response.status_code == 200:
            return SSEResponse(self.relay_events(response, mark))
        content = await until_disconnect(request, self.read_all(response))
        if content is None:
            self.counters.requests_aborted_total += 1
            return Response(status_code=499)
        if response.status_code != 200:
            return Response(content, response.status_code, media_type="application/json")
        data = json.loads(content)
        self.add_versions(data, mark)
        return JSONResponse(data)

    @staticmethod
    async def read_all(response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        finally:
            await response.aclose()  # also when cancelled: vLLM sees the disconnect and aborts

    def add_versions(self, data: dict, mark: int) -> None:
        versions = self.versions.since(mark)
        data["weight_versions"] = versions
        if data.get("model") == ADAPTER_NAME:
            data["model"] = self.served_name
        for choice in data.get("choices") or ():
            choice["weight_versions"] = versions

    async def relay_events(self, response: httpx.Response, mark: int) -> AsyncIterator[str]:
        """vLLM's server-sent events with weight versions added to each data chunk."""
        try:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    try:
                        chunk = json.loads(line[6:])
                    except ValueError:
                        chunk = None
                    if isinstance(chunk, dict) and "error" not in chunk:
                        self.add_versions(chunk, mark)
                        line = "data: " + json.dumps(chunk, separators=(",", ":"))
                yield line + "\n"
        finally:
            await response.aclose()

    # --- admin -----------------------------------------------------------------------------------

    def weights_path(self, req: UpdateWeightsRequest) -> Path:
        if req.path is None and self.config.run_dir is None:
            raise APIError(400, "'step' needs the server to know the run directory (set run_dir)", "step")
        path = (
            Path(os.path.expanduser(req.path))
            if req.path is not None
            else weights_dir(self.config.run_dir, req.step)
        )
        try:  # (os.path leaves an unknown user's ~name be, where pathlib raises)
            path = path.resolve()
            path.stat()  # here, not in vLLM's workers, whose errors come back as 500s
        except FileNotFoundError:
            pass  # the workers refuse it, naming the path
        except (OSError, RuntimeError) as e:  # a name too long, a symlink loop, no permission
            raise APIError(400, f"cannot read weights path '{path}': {e}", "path") from None
        return path

    async def rpc(self, method: str, args: list, timeout_s: float) -> list[dict]:
        """Call a worker-extension method on every vLLM worker; their results."""
        body = {"method": method, "args": args, "timeout": timeout_s}
        response = await self.call("POST", "/collective_rpc", json=body, timeout=timeout_s + 30)
        if response.status_code != 200:
            log.error("vLLM failed in %s: %s", method, response.text[:2000])
            raise APIError(
                500,
                f"vLLM failed in {method} ({response.status_code}: {response.text[:300]}); "
                "the served weights may be partly updated",
            )
        return response.json()["results"]

    async def update_weights(self, req: UpdateWeightsRequest) -> dict:
        if req.step is not None and self.config.weights.in_memory:
            return await self.receive_weights(req.step)
        path = self.weights_path(req)
        async with self.admin_lock:
            version = req.version
            if version is None:
                version = version_from_path(path)
            if version is None:
                version = self.versions.current + 1
            if self.config.vllm.max_lora_rank is not None:
                await self.load_adapter(path)
            else:
                results = await self.rpc(LOAD_METHOD, [str(path)], self.config.vllm.admin_timeout_s)
                refused = [r["error"] for r in results if not r.get("ok")]
                if refused:
                    raise APIError(
                        400,
                        f"cannot load weights from {path}: {refused[0]}; the old weights stay live",
                        "path",
                    )
            self.versions.advance(version)
        self.counters.weight_updates_total += 1
        log.info("loaded weights from %s as version %d", path, version)
        return {"weight_version": version, "path": str(path)}

    async def load_adapter(self, path: Path) -> None:
        """Load the LoRA adapter in `path` in place of the served one (vLLM checks it first)."""
        if not (path / "adapter_config.json").is_file():
            raise APIError(400, f"{path} is not a LoRA adapter (no adapter_config.json): this server "
                           "serves adapters (vllm.max_lora_rank is set)", "path")  # fmt: skip
        body = {"lora_name": ADAPTER_NAME, "lora_path": str(path), "load_inplace": True}
        response = await self.call(
            "POST", "/v1/load_lora_adapter", json=body, timeout=self.config.vllm.admin_timeout_s
        )
        if response.status_code != 200:
            try:
                reason = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                reason = response.text[:500]
            raise APIError(
                400, f"cannot load the LoRA adapter in {path}: {reason}; the old weights stay live", "path"
            )
        self.adapter_loaded = True

    async def receive_weights(self, version: int) -> dict:
        """Policy `version` from the trainer (broadcast or colocated), into every vLLM worker."""
        async with self.admin_lock:
            results = await self.rpc(RECEIVE_METHOD, [version], self.config.weights.transfer_timeout_s * 2)
            failed = [r for r in results if not r.get("ok")]
            if failed:
                status, message = int(failed[0]["status"]), failed[0]["error"]
                if status == 503:
                    message += "; the weights now mix two versions: this server must be restarted"
                else:
                    message += "; the old weights stay live"
                raise APIError(status, message, "step" if status == 400 else None)
            if "adapter_dir" in results[0]:  # a LoRA adapter, written where vLLM's LoRA API reads it
                await self.load_adapter(Path(results[0]["adapter_dir"]))
            self.versions.advance(version)
        self.counters.weight_updates_total += 1
        log.info(
            "received policy version %d (%s, %.3f s)", version, results[0]["route"], results[0]["seconds"]
        )
        return {"weight_version": version, "transport": results[0]["route"]}

    async def pause(self) -> dict:
        async with self.admin_lock:
            self.resumed.clear()
            await self.admin("/pause", params={"mode": "keep"})
        return {"paused": True, "weight_version": self.versions.current}

    async def resume(self) -> dict:
        async with self.admin_lock:
            await self.admin("/resume")
            self.resumed.set()
        return {"paused": False, "weight_version": self.versions.current}

    async def metrics(self) -> str:
        response = await self.call("GET", "/metrics")
        if response.status_code != 200:
            raise APIError(503, f"vLLM answered /metrics with {response.status_code}")
        upstream = response.text
        lines: list[str] = []
        metric(
            lines,
            "tandem_weight_version",
            "gauge",
            "Version of the weights being served.",
            self.versions.current,
        )
        metric(
            lines, "tandem_paused", "gauge", "1 while generation is paused.", int(not self.resumed.is_set())
        )
        for name, source in VLLM_GAUGES.items():
            metric(lines, name, "gauge", f"{source}, summed over engines.", sum_metric(upstream, source))
        metric(
            lines,
            "tandem_requests_waiting_for_resume",
            "gauge",
            "HTTP requests held while the server is paused.",
            self.counters.waiting_for_resume,
        )
        counters = {
            "tandem_http_requests_total": ("Generation requests received.", self.counters.requests_total),
            "tandem_http_requests_failed_total": (
                "Generation requests answered with an error.",
                self.counters.requests_failed_total,
            ),
            "tandem_http_requests_aborted_total": (
                "Generation requests whose client went away before the end.",
                self.counters.requests_aborted_total,
            ),
            "tandem_weight_updates_total": ("Successful weight updates.", self.counters.weight_updates_total),
        }
        for name, (help_text, value) in counters.items():
            metric(lines, name, "counter", help_text, value)
        return "\n".join(lines) + "\n" + upstream


def build_front(config: InferenceConfig, upstream: str, upstream_key: str) -> FastAPI:
    """The ASGI app of the front; `upstream` is vLLM's base URL, `upstream_key` its private API key."""
    front = VLLMFront(config, upstream, upstream_key)

    app = new_app("tandem inference (vLLM backend)", front.client.aclose, front.counters, config.api_key)
    app.state.front = front

    @app.get("/health")
    async def health() -> dict:
        response = await front.call("GET", "/health", timeout=10)
        if response.status_code != 200:
            raise APIError(503, f"vLLM is unhealthy ({response.status_code})")
        return {
            "status": "ok",
            "weight_version": front.versions.current,
            "paused": not front.resumed.is_set(),
            "backend": "vllm",
            "pid": os.getpid(),  # (the launcher checks it answers for its own server)
        }

    @app.get("/v1/models")
    async def models() -> Response:
        response = await front.call("GET", "/v1/models")
        if response.status_code != 200:
            return Response(response.content, response.status_code, media_type="application/json")
        body = response.json()
        for card in body.get("data") or ():
            card["weight_version"] = front.versions.current
        return JSONResponse(body)

    for path in GENERATION_PATHS:
        app.add_api_route(path, front.generate, methods=["POST"])

    @app.post("/update_weights")
    async def update_weights(req: UpdateWeightsRequest) -> dict:
        return await front.update_weights(req)

    @app.post("/pause")
    async def pause() -> dict:
        return await front.pause()

    @app.post("/resume")
    async def resume() -> dict:
        return await front.resume()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await front.metrics(), media_type="text/plain; version=0.0.4")

    return app
