"""The OpenAI-compatible HTTP server over an `Engine` (FastAPI).

`build_app(engine, tokenizer, config)` returns the ASGI app; `tandem.inference.cli` runs it with
uvicorn. The server tokenises prompts (chat messages through the tokenizer's chat template),
validates everything the engine would choke on before calling it, streams with server-sent
events, and aborts a request in the engine as soon as its client goes away.
"""

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import Engine, WeightLoadError, WeightUpdateConflict
from tandem.inference.engine.streams import RequestTimes, request_times
from tandem.inference.errors import APIError, error_body
from tandem.inference.generation import Choice, PromptJob, collect, merge, run_prompt, sampling_params
from tandem.inference.http import (
    FastJSONResponse,
    SSEResponse,
    new_app,
    read_body,
    sse,
    until_disconnect,
    wait_for_resume,
)
from tandem.inference.kv_routes import add_kv_routes
from tandem.inference.metrics import RateMeter, ServerCounters, render_metrics
from tandem.inference.prefill import PrefillServers, StagingLeases
from tandem.inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    UpdateWeightsRequest,
)
from tandem.inference.responses import ResponseBuilder, TokenTexts
from tandem.transport.weights import weights_dir

log = logging.getLogger("tandem.inference")

TIMING_HEADER = "x-tandem-timing"
"""A whole response carries its request's times (RequestTimes) in this header when the request
has it (any value): benchmarks/inference_throughput.py reads where a batch's time went."""

OFF_LOOP_CHARS = 1 << 15
"""A request whose text to tokenise (a completion's text prompts; a chat's body) is longer than
this is tokenised (a chat: rendered and tokenised) in a worker thread. In the event loop, at
~1-3 µs a character, it held every other request and /health up: for 23 s with an 8 MB prompt.
Shorter ones stay in the event loop, where they take less than a thread's hand-off would add."""

T = TypeVar("T")


async def off_loop(chars: int, work: Callable[[], T]) -> T:
    """`work()` for a text of `chars` characters: in the event loop if short, else in a thread
    (the tokenizers library releases the GIL while it encodes)."""
    return work() if chars <= OFF_LOOP_CHARS else await asyncio.to_thread(work)


def model_vocab_size(name: str) -> int | None:
    """Rows of the model's embedding (often more than the tokenizer's size): valid token ids."""
    from transformers import AutoConfig  # imported here: it takes seconds

    try:
        return int(AutoConfig.from_pretrained(name).vocab_size)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


class Server:
    """State shared by the routes: the engine, the tokenizer, pause gate, counters."""

    def __init__(self, engine: Engine, tokenizer: Any, config: InferenceConfig) -> None:
        self.engine = engine
        self.broken: str | None = None  # set when a failed transfer left the weights mixing versions
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.served_model_name or config.model.name
        self.accepted_names = {self.model_name, config.model.name}
        self.max_n = config.engine.max_n
        self.vocab_size = model_vocab_size(config.model.name) or len(tokenizer)
        self.token_texts = TokenTexts(tokenizer)
        self.counters = ServerCounters()
        self.rate = RateMeter()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.update_lock = asyncio.Lock()
        self.id_prefix = uuid.uuid4().hex[:16]
        self.request_counter = itertools.count()
        self.staging = StagingLeases(config.prefill.staging_buffers)  # (as a prefill server)
        self.prefill = (
            PrefillServers(config.prefill, config.engine.block_size, config.api_key, self.counters)
            if config.prefill.servers
            else None
        )

    # --- validation ---------------------------------------------------------------------------

    def check_common(self, req: SamplingFields) -> None:
        if req.model is not None and req.model not in self.accepted_names:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'.",
                "model",
            )
        if req.n > self.max_n:
            raise APIError(400, f"n must be at most {self.max_n} (got {req.n})", "n")
        for token in req.stop_token_ids or ():
            if token >= self.vocab_size:
                raise APIError(
                    400,
                    f"stop_token_ids: {token} is outside the vocabulary (size {self.vocab_size})",
                    "stop_token_ids",
                )

    def check_prompt_ids(self, ids: list[int]) -> None:
        if max(ids, default=0) >= self.vocab_size:
            bad = next(t for t in ids if t >= self.vocab_size)
            raise APIError(
                400, f"prompt: token id {bad} is outside the vocabulary (size {self.vocab_size})", "prompt"
            )

    def resolve_max_tokens(
        self,
        prompt_len: int,
        requested: int | None,
        default: int | None,
        field: str = "max_tokens",
        prompt_field: str = "prompt",
    ) -> int:
        """The completion budget; prompt + budget must fit the context, as vLLM requires. `field`
        names the request field `requested` came from, `prompt_field` the one the prompt came from
        (chat: messages): the error names the prompt when no budget could fit beside it."""
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves none for the completion. Please reduce the length "
                "of the prompt.",
                prompt_field,
            )
        if requested is None and default is None:  # the rest of the context
            return limit - prompt_len
        max_tokens = requested if requested is not None else default
        assert max_tokens is not None
        if prompt_len + max_tokens > limit or max_tokens < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                "completion). Please reduce the length of the prompt or of the completion.",
                field if requested is not None else prompt_field,
            )
        return max_tokens

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        own_template = (req.chat_template_kwargs or {}).get("chat_template") is not None
        if own_template and not self.config.trust_request_chat_template:  # (its loops would run here)
            raise APIError(
                400,
                "chat_template_kwargs.chat_template: this server renders only its model's own chat "
                "template (a request's template could run without end; trust_request_chat_template "
                "allows them)",
                "chat_template_kwargs.chat_template",
            )
        messages = [m.for_template() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=req.tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokenize=False,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:  # refused here, not by the engine: a stream would already have begun
            raise APIError(400, "the chat template rendered these messages as an empty prompt", "messages")
        return ids

    # --- pause gate -----------------------------------------------------------------------------

    async def wait_until_resumed(self, request: Request) -> None:
        if self.broken is not None:
            raise APIError(503, self.broken)
        await wait_for_resume(self.resumed, self.counters, self.config.pause_timeout_s, request)

    # --- generation -------------------------------------------------------------------------------

    def new_request_id(self, kind: str) -> str:
        """`kind`-<this server's random prefix><a counter, hex>: unique among this server's
        requests and across servers, without a system call per request (uuid4 reads the OS's
        random source)."""
        return f"{kind}-{self.id_prefix}{next(self.request_counter):x}"

    def jobs(
        self,
        request_id: str,
        req: SamplingFields,
        prompts: list[list[int]],
        max_tokens: list[int],
        top_logprobs: int | None,
        stream: bool,
    ) -> list[PromptJob]:
        """The engine requests of a response with id `request_id`: one per prompt."""
        return [
            PromptJob(
                request_id=f"{request_id}-{i}",
                prompt_index=i,
                prompt_ids=ids,
                params=sampling_params(req, max_tokens[i], top_logprobs),
                n=req.n,
                stop=req.stop_strings,
                include_stop=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                incremental=stream,
                stream_interval_s=self.config.stream_interval_s,
                logprobs=top_logprobs is not None,
            )
            for i, ids in enumerate(prompts)
        ]

    def choices_stream(self, jobs: list[PromptJob]) -> AsyncIterator[Choice]:
        return merge([run_prompt(self.engine, self.tokenizer, job, self.rate.add) for job in jobs])

    async def respond(
        self,
        request: Request,
        req: SamplingFields,
        builder: ResponseBuilder,
        jobs: list[PromptJob],
        received: float,
    ) -> Response:
        """The response to a request that reached the server at `received` (time.monotonic())."""
        if self.prefill is not None:
            await self.prefill.prefill(self.engine, [job.prompt_ids for job in jobs])
        count = sum(job.n for job in jobs)
        if req.stream:
            return SSEResponse(self.stream_events(req, builder, jobs, count, time.monotonic()))
        wanted = TIMING_HEADER.encode()
        times = RequestTimes(received) if any(k == wanted for k, _ in request.scope["headers"]) else None
        token = request_times.set(times)
        try:
            choices = await until_disconnect(request, collect(self.choices_stream(jobs), count))
        finally:
            request_times.reset(token)
        if choices is None:
            self.counters.requests_aborted_total += 1
            return Response(status_code=499)
        body = builder.full(choices)
        headers = None if times is None else {TIMING_HEADER: times.header(time.monotonic())}
        return FastJSONResponse(body, headers=headers)

    async def stream_events(
        self, req: SamplingFields, builder: ResponseBuilder, jobs: list[PromptJob], count: int, started: float
    ) -> AsyncIterator[str]:
        latest: dict[int, Choice] = {}
        finished = False
        try:
            for chunk in builder.first_chunks(count):
                yield sse(chunk)
            async with aclosing(self.choices_stream(jobs)) as stream:
                async for choice in stream:
                    if not latest:
                        self.counters.time_to_first_token.observe(time.monotonic() - started)
                    latest[choice.index] = choice
                    event = builder.chunk_event(choice)
                    if event is not None:
                        yield event
            if req.include_usage_in_stream:
                yield sse(builder.usage_chunk([latest[i] for i in sorted(latest)]))
            finished = True
        except APIError as e:
            self.counters.requests_failed_total += 1
            yield sse(error_body(e.status, e.message, e.param))
            finished = True
        except Exception as e:
            log.exception("error while streaming request %s", builder.request_id)
            self.counters.requests_failed_total += 1
            yield sse(error_body(500, f"internal server error: {type(e).__name__}: {e}"))
            finished = True
        finally:
            if not finished:
                self.counters.requests_aborted_total += 1
        yield sse("[DONE]")

    # --- weights --------------------------------------------------------------------------------

    def weights_path(self, req: UpdateWeightsRequest) -> Path:
        if req.path is not None:  # (os.path leaves an unknown user's ~name be; pathlib raises)
            return Path(os.path.expanduser(req.path))
        if self.config.run_dir is None:
            raise APIError(400, "'step' needs the server to know the run directory (set run_dir)", "step")
        return weights_dir(self.config.run_dir, req.step)

    async def receive_weights(self, version: int) -> int:
        """Policy `version` over the in-memory transport; errors as API errors naming the step."""
        from tandem.transport.weight_link import LinkError, TransferError, TransferRefused  # loads torch

        try:
            return await self.engine.receive_weights(version)
        except WeightUpdateConflict as e:
            raise APIError(409, f"{e}; the old weights stay live", "step") from None
        except TransferRefused as e:
            raise APIError(400, f"{e}; the old weights stay live", "step") from None
        except (TransferError, LinkError) as e:
            if getattr(e, "partial", False):
                self.broken = f"{e}; the weights now mix two versions: this server must be restarted"
                raise APIError(503, self.broken) from None
            raise APIError(504, f"{e}; the old weights stay live") from None


def build_app(engine: Engine, tokenizer: Any, config: InferenceConfig) -> FastAPI:
    """With an in-memory `weights.transport`, `{"step": N}` updates receive version N by the
    engine's receiver; else they load the run's weights/step_N."""
    server = Server(engine, tokenizer, config)

    async def completions(request: Request) -> Response:
        received = time.monotonic()
        req = await read_body(request, CompletionRequest)
        server.check_common(req)
        given = req.prompts
        text = sum(len(p) for p in given if isinstance(p, str))
        prompts = await off_loop(
            text, lambda: [tokenizer.encode(p) if isinstance(p, str) else p for p in given]
        )
        for ids in prompts:
            server.check_prompt_ids(ids)
        max_tokens = [server.resolve_max_tokens(len(ids), req.max_tokens, 16) for ids in prompts]
        await server.wait_until_resumed(request)
        builder = ResponseBuilder(
            chat=False,
            request_id=server.new_request_id("cmpl"),
            model=server.model_name,
            token_texts=server.token_texts,
            prompts=prompts,
            top_logprobs=req.logprobs,
            return_token_ids=req.return_token_ids,
            tokens_as_ids=req.return_tokens_as_token_ids,
        )
        jobs = server.jobs(builder.request_id, req, prompts, max_tokens, req.logprobs, req.stream)
        return await server.respond(request, req, builder, jobs, received)

    async def chat_completions(request: Request) -> Response:
        received = time.monotonic()
        req = await read_body(request, ChatCompletionRequest)
        server.check_common(req)
        prompt = await off_loop(len(await request.body()), lambda: server.chat_prompt(req))  # (body: read)
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_tokens = server.resolve_max_tokens(len(prompt), req.completion_limit, None, field, "messages")
        await server.wait_until_resumed(request)
        builder = ResponseBuilder(
            chat=True,
            request_id=server.new_request_id("chatcmpl"),
            model=server.model_name,
            token_texts=server.token_texts,
            prompts=[prompt],
            top_logprobs=req.num_top_logprobs,
            return_token_ids=req.return_token_ids,
            tokens_as_ids=req.return_tokens_as_token_ids,
        )
        jobs = server.jobs(builder.request_id, req, [prompt], [max_tokens], req.num_top_logprobs, req.stream)
        return await server.respond(request, req, builder, jobs, received)

    async def shutdown() -> None:
        if server.prefill is not None:
            await server.prefill.close()
        await engine.shutdown()

    generation = {"/v1/completions": completions, "/v1/chat/completions": chat_completions}
    app = new_app("tandem inference", shutdown, server.counters, config.api_key, generation)
    app.state.server = server

    @app.get("/health")
    async def health() -> dict:
        if engine.dead_reason is not None:
            raise APIError(503, f"the engine died: {engine.dead_reason}")
        if server.broken is not None:
            raise APIError(503, server.broken)
        return {
            "status": "ok",
            "weight_version": engine.weight_version,
            "paused": not server.resumed.is_set(),
            "weights": await engine.weight_transport(),
            "pid": os.getpid(),  # (the launcher checks it answers for its own server)
        }

    def model_card() -> dict:
        return {
            "id": server.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "root": config.model.name,
            "max_model_len": engine.max_model_len,
            "weight_version": engine.weight_version,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # (openai's client.models.retrieve; ids may hold slashes)
    async def model(model_id: str) -> dict:
        if model_id not in (server.model_name, config.model.name):  # (requests may use either)
            raise APIError(
                404,
                f"the model {model_id!r} does not exist: this server serves {server.model_name!r}",
                "model",
            )
        return model_card()

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        req = await read_body(request, UpdateWeightsRequest)
        if req.step is not None and config.weights.in_memory:
            async with server.update_lock:
                version = await server.receive_weights(req.step)
            server.counters.weight_updates_total += 1
            transport = await engine.weight_transport()
            log.info("received policy version %d (%s)", version, transport)
            return {"weight_version": version, "transport": transport}
        path = server.weights_path(req)
        source = "path" if req.path is not None else "step"  # (the field the client named the weights by)
        async with server.update_lock:
            try:
                if req.version is None:
                    version = await engine.update_weights(path)
                else:
                    version = await engine.update_weights(path, version=req.version)  # type: ignore[call-arg]
            except WeightUpdateConflict as e:
                raise APIError(409, f"{e}; the old weights stay live", source) from None
            except WeightLoadError as e:
                raise APIError(
                    400, f"cannot load weights from {path}: {e}; the old weights stay live", source
                ) from None
        server.counters.weight_updates_total += 1
        log.info("loaded weights from %s as version %d", path, version)
        return {"weight_version": version, "path": str(path)}

    add_kv_routes(app, server)

    @app.post("/pause")
    async def pause() -> dict:
        server.resumed.clear()
        await engine.pause()
        return {"paused": True, "weight_version": engine.weight_version}

    @app.post("/resume")
    async def resume() -> dict:
        await engine.resume()
        server.resumed.set()
        return {"paused": False, "weight_version": engine.weight_version}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_metrics(engine.stats(), server.counters, server.rate.rate())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
