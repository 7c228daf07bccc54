"""A thin async client of one tandem inference server, and a pool that spreads work over several.

Chat requests go through the official `openai.AsyncOpenAI` client (exposed as `.openai` for
environments that want the raw API; imported where used, since importing it takes seconds and
the launcher reads environments without any server); tandem's own fields ride along in `extra_body`
(`return_token_ids`) and come back as extra response fields (`prompt_token_ids`, per-choice
`token_ids` and weight versions). Token ids are taken from the server as-is, never re-tokenised.

Every request is retried with exponential backoff on connection errors, timeouts and 5xx
answers; after the last retry a `ServerUnavailable` names the server. A retry's warning is logged
once per server and reason every REPEAT_WINDOW seconds: when a server dies, every request in
flight fails alike (a step's 128 rollouts gave 128 copies of one long line), so the repeats are
counted and the count goes with the next warning of that reason.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tandem.cli import UserError
from tandem.client.config import ClientConfig, SamplingConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BACKOFF = 30.0
REPEAT_WINDOW = 10.0


class ServerUnavailable(UserError):
    """An inference server did not answer after all retries."""


class RequestRejected(RuntimeError):
    """The server answered with a 4xx: the request itself is wrong; retrying cannot help."""


class RepeatedWarnings:
    """Logs a message at most once per `window` seconds; repeats inside the window are counted
    and the count is added to the message's next warning."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._seen: dict[str, tuple[float, int]] = {}  # message: (last logged at, repeats since)

    def warn(self, message: str, detail: str = "") -> None:
        """Log `message` + `detail` (what may differ between repeats, such as a delay)."""
        now = time.monotonic()
        logged_at, repeats = self._seen.get(message, (-self.window, 0))
        if now - logged_at < self.window:
            self._seen[message] = (logged_at, repeats + 1)
            return
        if repeats:
            detail += f" ({repeats} more like it in the {now - logged_at:.0f} s before)"
        if len(self._seen) > 256:  # distinct reasons are few; never let the record grow unbounded
            self._seen.clear()
        self._seen[message] = (now, 0)
        log.warning("%s%s", message, detail)


@dataclass
class Generation:
    """One sampled completion (one choice) as the server produced it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    """Policy versions that produced this choice's tokens, oldest first (several when the weights
    changed mid-generation)."""
    finish_reason: str


@dataclass
class ChatResult:
    prompt_token_ids: list[int]
    choices: list[Generation]


def is_retryable(error: Exception) -> bool:
    import openai

    if isinstance(error, openai.APIStatusError):
        return error.status_code >= 500 or error.status_code == 429
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500 or error.response.status_code == 429
    return isinstance(error, openai.APIConnectionError | httpx.TransportError | asyncio.TimeoutError)


def describe(error: Exception) -> str:
    import openai

    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}: {error.message}"
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}: {error.response.text[:300]}"
    return f"{type(error).__name__}: {error}".strip()


def generation(choice: Any, text: str | None, logprobs: list[float] | None) -> Generation:
    """A choice of either endpoint as a Generation: token ids, versions and finish reason come
    from the same fields; `text` and `logprobs` are what the caller read from its endpoint's shape."""
    extra = choice.model_extra or {}
    token_ids = extra.get("token_ids")
    if token_ids is None:
        raise RequestRejected("the server returned no 'token_ids' (it must support return_token_ids)")
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RequestRejected("the server's logprobs do not match its token_ids one to one")
    versions = extra.get("weight_versions")
    if versions is None:
        versions = [extra["weight_version"]] if "weight_version" in extra else []
    return Generation(
        text=text or "",
        token_ids=list(token_ids),
        logprobs=[float(lp) for lp in logprobs],
        weight_versions=sorted(set(versions)),
        finish_reason=choice.finish_reason or "stop",
    )


def parse_choice(choice: Any) -> Generation:
    """A /v1/chat/completions choice (message and `logprobs.content`)."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    logprobs = [item.logprob for item in content] if content is not None else None
    return generation(choice, choice.message.content, logprobs)


def parse_completion_choice(choice: Any) -> Generation:
    """A /v1/completions choice (text and `logprobs.token_logprobs`)."""
    logprobs = choice.logprobs.token_logprobs if choice.logprobs is not None else None
    return generation(choice, choice.text, logprobs)


def seed_field(sampling: SamplingConfig) -> dict[str, int]:
    """The request's `seed`, when its sampling has one (an unseeded request sends none)."""
    return {} if sampling.request_seed is None else {"seed": sampling.request_seed}


class InferenceClient:
    """One server: chat completions with token ids, plus the admin endpoints."""

    def __init__(self, base_url: str, cfg: ClientConfig, model: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.cfg = cfg
        self.model = model
        self.max_model_len: int | None = None  # the server's context length, learned by connect()
        self.in_flight = 0
        self.retry_warnings = RepeatedWarnings(REPEAT_WINDOW)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=cfg.request_timeout, headers=headers)
        import openai

        self.openai = openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=cfg.api_key or "EMPTY",
            timeout=cfg.request_timeout,
            max_retries=0,
        )

    async def with_retries(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        import openai

        delay = self.cfg.retry_backoff
        for attempt in range(self.cfg.max_retries + 1):
            try:
                return await call()
            except Exception as e:
                if isinstance(e, openai.APIStatusError | httpx.HTTPStatusError) and not is_retryable(e):
                    raise RequestRejected(f"{self.base_url} rejected {what}: {describe(e)}") from None
                if not is_retryable(e):
                    raise
                if attempt == self.cfg.max_retries:
                    raise ServerUnavailable(
                        f"inference server {self.base_url} did not answer {what} after "
                        f"{attempt + 1} attempts: {describe(e)}"
                    ) from None
                self.retry_warnings.warn(
                    f"{self.base_url}: {what} failed ({describe(e)})", f"; retry in {delay:.1f}s"
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF)
        raise AssertionError("unreachable")

    async def post(
        self,
        path: str,
        body: dict | None = None,
        retry: bool = True,
        timeout: tuple[float, str] | None = None,
    ) -> dict:
        """POST `path`; `timeout` = (seconds, the settings they come from) instead of request_timeout."""

        async def call() -> dict:
            limit = timeout[0] if timeout else httpx.USE_CLIENT_DEFAULT
            response = await self.http.post(path, json=body or {}, timeout=limit)
            response.raise_for_status()
            return response.json() if response.content else {}

        if retry:
            return await self.with_retries(f"POST {path}", call)
        import openai

        try:
            return await call()
        except httpx.TimeoutException:
            seconds, source = timeout or (self.cfg.request_timeout, "client.request_timeout")
            raise RequestRejected(
                f"{self.base_url} did not answer POST {path} within {seconds:g} s ({source})"
            ) from None
        except Exception as e:
            if isinstance(e, openai.APIStatusError | httpx.HTTPStatusError) or is_retryable(e):
                raise RequestRejected(f"{self.base_url} failed POST {path}: {describe(e)}") from None
            raise

    async def connect(self) -> str:
        """Check the server answers and learn the model name it serves (returned) and its context
        length (`max_model_len`, where the server says: tandem's and vLLM's do)."""

        async def call() -> dict:
            response = await self.http.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]

        served = await self.with_retries("GET /v1/models", call)
        self.model = self.model or served["id"]
        self.max_model_len = served.get("max_model_len")
        return served["id"]

    async def chat(
        self, messages: list[dict[str, Any]], sampling: SamplingConfig, n: int = 1, **extra: Any
    ) -> ChatResult:
        """`n` completions of one conversation, with the server's token ids and logprobs."""

        async def call() -> Any:
            return await self.openai.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=True,
                **seed_field(sampling),
                extra_body={"return_token_ids": True, **extra},
            )

        response = await self.with_retries("a chat completion", call)
        prompt_ids = (response.model_extra or {}).get("prompt_token_ids")
        if prompt_ids is None:
            raise RequestRejected(f"{self.base_url} returned no 'prompt_token_ids' (return_token_ids)")
        choices = sorted(response.choices, key=lambda c: c.index)
        return ChatResult(prompt_token_ids=list(prompt_ids), choices=[parse_choice(c) for c in choices])

    async def complete(
        self, prompt_ids: list[int], sampling: SamplingConfig, n: int = 1, **extra: Any
    ) -> ChatResult:
        """`n` completions of a prompt given as token ids (/v1/completions): how multi-turn
        environments continue a conversation without re-rendering or re-tokenising it."""

        async def call() -> Any:
            return await self.openai.completions.create(
                model=self.model,
                prompt=prompt_ids,
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=0,
                **seed_field(sampling),
                extra_body={"return_token_ids": True, **extra},
            )

        response = await self.with_retries("a completion", call)
        choices = sorted(response.choices, key=lambda c: c.index)
        echoed = (choices[0].model_extra or {}).get("prompt_token_ids") if choices else None
        if echoed is not None and list(echoed) != list(prompt_ids):
            raise RequestRejected(f"{self.base_url} echoed different prompt_token_ids than it was sent")
        return ChatResult(
            prompt_token_ids=list(prompt_ids), choices=[parse_completion_choice(c) for c in choices]
        )

    async def update_weights(self, path: Path) -> int:
        """Have the server load a weights directory; returns the version it now serves."""
        return int((await self.post("/update_weights", {"path": str(path)}))["weight_version"])

    async def receive_weights(self, version: int, timeout: tuple[float, str]) -> int:
        """Have the server receive policy `version` from the trainer (in-memory transports); returns
        the version it now serves. Not retried: the trainer streams each version once. `timeout`
        (seconds, their settings) must cover the server's own waits for the trainer."""
        answer = await self.post("/update_weights", {"step": version}, retry=False, timeout=timeout)
        return int(answer["weight_version"])

    async def close(self) -> None:
        await self.http.aclose()
        await self.openai.close()


class ServerPool:
    """All servers; `lease()` hands out the least-loaded one (round-robin among equals). Servers in
    `weight_only` (prefill servers: docs/inference-engine.md) take every weight update but are
    never leased."""

    def __init__(
        self, urls: list[str], cfg: ClientConfig, model: str = "", weight_only: list[str] | None = None
    ) -> None:
        self.cfg = cfg
        self.clients = [InferenceClient(url, cfg, model) for url in urls]
        self.every = self.clients + [InferenceClient(url, cfg, model) for url in weight_only or []]
        self.next = 0
        self.slots = asyncio.Semaphore(cfg.max_concurrent_groups)

    async def connect(self, seq_len: int | None = None) -> str:
        """Connect every server; with `seq_len`, refuse one whose context is shorter (its requests
        would fail one by one with a 400 at the first long sample)."""
        names = await asyncio.gather(*(c.connect() for c in self.every))
        for client in self.every:
            if seq_len is not None and client.max_model_len is not None and client.max_model_len < seq_len:
                raise UserError(
                    f"{client.base_url} serves a context of {client.max_model_len} tokens (max_model_len), "
                    f"less than seq_len {seq_len}: start it with a longer one or lower seq_len"
                )
        return names[0]

    def pick(self) -> InferenceClient:
        order = self.clients[self.next :] + self.clients[: self.next]
        chosen = min(order, key=lambda c: c.in_flight)
        self.next = (self.clients.index(chosen) + 1) % len(self.clients)
        return chosen

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[InferenceClient]:
        """A server for one group's requests, counted as busy while the lease is held."""
        async with self.slots:
            client = self.pick()
            client.in_flight += 1
            try:
                yield client
            finally:
                client.in_flight -= 1

    async def update_weights(self, path: Path) -> list[int]:
        return list(await asyncio.gather(*(c.update_weights(path) for c in self.every)))

    async def receive_weights(self, version: int, timeout: tuple[float, str]) -> list[int]:
        """All servers at once: the trainer streams to all of them together."""
        return list(await asyncio.gather(*(c.receive_weights(version, timeout) for c in self.every)))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.every))
