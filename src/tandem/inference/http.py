"""HTTP pieces both fronts share: tandem's own server (server.py) and the vLLM backend's front
(vllm/proxy.py). Each front answers the same paths with the same API-key check, request counters,
pause behaviour and server-sent-event streaming, so these live here once.

Invariant: a client that goes away stops its work. A streamed response stops (and closes its
generator, which aborts the engine request) on the disconnect, even while no token is being
sent; a whole response's work is cancelled the same way (`until_disconnect`).
"""

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.inference.errors import APIError, error_response, install_error_handlers
from tandem.inference.metrics import ServerCounters

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
Endpoint = Callable[[Request], Awaitable[Response]]
OPEN_PATHS = ("/health", "/metrics")
"""Paths answered without the API key (liveness probes and scrapers)."""
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


async def _disconnected(receive: Receive) -> None:
    """Return when the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Awaitable[T], receive: Receive) -> "asyncio.Future[T]":
    """Run `work` until it ends or the client disconnects, which cancels it; returns its task, done.
    Cancelling the caller cancels `work` too, and raises once `work` has ended."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    watcher.add_done_callback(lambda _: task.cancel())  # (no-op once the task is done)
    try:
        await task
    except (Exception, asyncio.CancelledError):  # the caller finds the outcome in the task
        pass
    finally:
        watcher.cancel()
        if not task.done():  # the caller was cancelled while `work` went on
            task.cancel()
            await asyncio.wait((task,))
    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
        raise asyncio.CancelledError
    return task


class FastJSONResponse(Response):
    """A JSON response serialized by pydantic-core (Rust): a whole completion with a few hundred
    token ids in a quarter of the time of JSONResponse's json.dumps. The same JSON, with floats
    in their shortest round-trip form (0.00001 for 1e-05) and non-finite ones written NaN or
    Infinity, as stream chunks write them, instead of failing."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return to_json(content)


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that stops, and closes its generator (aborting the request in the
    engine), the moment the client disconnects, even while no token is being sent.

    Plain asyncio cancellation (delivered once) rather than a task-group scope, so the generator's
    cleanup can still await the engine."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            streaming = await _unless_disconnected(self.stream_response(send), receive)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        error = None if streaming.cancelled() else streaming.exception()
        if isinstance(error, Exception) and not isinstance(error, OSError):
            raise error


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, or cancel it (aborting the engine request) if the client disconnects first."""
    task = await _unless_disconnected(work, request.receive)
    return None if task.cancelled() else task.result()


async def request_body(request: Request) -> bytes:
    """The request's body; a client that leaves before all of it arrived gets the 499 of a client
    gone (no one reads it), not a 500 and a logged traceback (starlette's ClientDisconnect)."""
    try:
        return await request.body()
    except ClientDisconnect:
        raise APIError(499, "the client disconnected before its request body arrived") from None


async def read_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as `model`, parsed and validated in one pass by pydantic; problems
    become the same 400 as FastAPI's own body validation (errors.py). Generation routes read their
    bodies this way: FastAPI's path (JSON to Python objects, then field-by-field validation)
    costs the event loop several times more per request, time that a batch of requests arriving
    together spends holding the GIL against the engine thread. The native server's other POST
    routes do too, for the same errors whatever the content type (FastAPI's answered bodies that
    are not UTF-8 with "There was an error parsing the body", and JSON sent as text/plain with
    "Input should be a valid dictionary")."""
    body = await request_body(request)
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def new_app(
    title: str,
    on_shutdown: Callable[[], Awaitable[None]],
    counters: ServerCounters,
    api_key: str | None,
    generation: dict[str, Endpoint] | None = None,
) -> FastAPI:
    """A front's app without its other routes: tandem's error bodies, the API-key gate and request
    counters, and `on_shutdown` awaited when the server stops. `generation`: the endpoints of
    (some of) GENERATION_PATHS, answered by the gate itself (see Gatekeeper)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await on_shutdown()

    app = FastAPI(title=title, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(Gatekeeper, counters=counters, api_key=api_key, endpoints=generation or {})
    return app


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class Gatekeeper:
    """ASGI middleware: checks the API key and counts generation requests and their failures.
    It answers the generation paths in `endpoints` itself (POST; other methods get a 405), with
    the app's error handlers: FastAPI's routing, dependency solving and the middleware layers
    below this one would cost a request more event-loop time than its own work.

    Written against raw ASGI, not `@app.middleware`, which would re-wrap streamed responses and
    delay noticing a client's disconnect."""

    def __init__(
        self, app: ASGIApp, counters: ServerCounters, api_key: str | None, endpoints: dict[str, Endpoint]
    ) -> None:
        self.app = app
        self.counters = counters
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.expected is not None and path not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    401, "invalid or missing API key (send 'Authorization: Bearer KEY')"
                )
                await response(scope, receive, send)
                return
        if path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.counters.requests_total += 1

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.counters.requests_failed_total += 1
            await send(message)

        endpoint = self.endpoints.get(path)
        try:
            if endpoint is None:
                await self.app(scope, receive, send_counting)
            else:
                await _serve(endpoint, scope, receive, send_counting)
        except Exception:  # answered with a 500 by the outermost error middleware
            self.counters.requests_failed_total += 1
            raise


async def _serve(endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer a request with `endpoint`, or with the app's handler of the error it raised (as
    Starlette's routing does; errors without a handler go up to the 500 of the outermost
    middleware)."""
    request = Request(scope, receive, send)
    try:
        if scope["method"] != "POST":
            raise HTTPException(405)
        response = await endpoint(request)
    except Exception as e:
        handlers = scope["app"].exception_handlers
        handler = next((handlers[c] for c in type(e).__mro__ if c in handlers), None)
        if handler is None or handler is handlers.get(Exception):
            raise
        response = await handler(request, e)
    await response(scope, receive, send)


async def wait_for_resume(
    resumed: asyncio.Event, counters: ServerCounters, timeout_s: float, request: Request
) -> None:
    """Hold a generation request while the server is paused; 503 after `timeout_s`. A client that
    disconnects meanwhile ends the wait at once (a 499 to no one, counted as aborted), rather than
    staying counted among those waiting for resume until the pause ends."""
    if resumed.is_set():
        return
    counters.waiting_for_resume += 1
    try:
        waiting = await _unless_disconnected(asyncio.wait_for(resumed.wait(), timeout_s), request.receive)
        if waiting.cancelled():
            counters.requests_aborted_total += 1
            raise APIError(499, "the client disconnected while the server was paused")
        waiting.result()
    except TimeoutError:
        raise APIError(
            503, f"the server is paused (weights are being updated) and did not resume within {timeout_s:g} s"
        ) from None
    finally:
        counters.waiting_for_resume -= 1
