"""Drive the engine for one HTTP request: sampling settings, the n choices of each prompt, stop
strings, weight versions, and merging several prompts' streams into one.

The HTTP layer formats what this module produces (`Choice` objects that grow as tokens arrive).
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from tandem.inference.engine.api import Engine, SamplingParams
from tandem.inference.errors import APIError
from tandem.inference.protocol import SamplingFields
from tandem.inference.stop import TextTracker, Tokenizer


def sampling_params(req: SamplingFields, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        max_tokens=max_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        top_logprobs=top_logprobs or 0,
    )


@dataclass
class Choice:
    """One sample of one prompt, as far as it has been generated."""

    index: int  # position in the response's `choices`
    prompt_index: int
    tracker: TextTracker
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Sequence[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version of each token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    streamed_tokens: int = 0  # tokens already sent in stream chunks
    streamed_offset: int = 0  # completions' logprobs: text_offset of the next streamed token

    @property
    def token_ids(self) -> list[int]:
        return self.tracker.token_ids

    @property
    def weight_versions(self) -> list[int]:
        """The distinct weight versions that produced this choice, oldest first."""
        return sorted(set(self.versions))


@dataclass
class PromptJob:
    """One engine request: a prompt and the settings of its n samples."""

    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stop: Sequence[str]
    include_stop: bool
    skip_special_tokens: bool
    incremental: bool  # decode as tokens arrive (streaming); otherwise once at the end
    stream_interval_s: float = 0.0  # a streamed response's least time between chunks (after the first)
    logprobs: bool = True  # keep each token's logprobs (the response shows them)


async def run_prompt(
    engine: Engine, tokenizer: Tokenizer, job: PromptJob, on_tokens: Callable[[int], None] = lambda _: None
) -> AsyncIterator[Choice]:
    """Yield a choice each time it grows or finishes, until all n samples have finished;
    `on_tokens(k)` hears of every k tokens a choice gained (the server's tokens/s meter)."""
    choices = [
        Choice(
            index=job.prompt_index * job.n + i,
            prompt_index=job.prompt_index,
            tracker=TextTracker(
                tokenizer, job.stop, job.include_stop, job.skip_special_tokens, job.incremental
            ),
        )
        for i in range(job.n)
    ]
    stop_ids = set(job.params.stop_token_ids)
    unfinished = job.n
    started = False
    # without streaming or stop strings nothing needs the tokens before the request ends
    stream = job.incremental or bool(job.stop)
    interval = job.stream_interval_s if job.incremental else 0.0  # (stop strings alone: every step)
    generating = engine.generate(job.request_id, job.prompt_ids, job.params, job.n, stream, interval)
    async with aclosing(generating) as updates:
        while True:
            try:
                update = await anext(updates)
            except StopAsyncIteration:
                break
            except ValueError as e:
                if started:
                    raise
                raise APIError(400, f"the engine refused the request: {e}") from None  # its validation
            started = True
            choice = choices[update.index]
            if choice.finish_reason is not None:
                continue  # already ended by a stop string; the engine may still have sent tokens
            used = choice.tracker.add(update.token_ids)
            on_tokens(used)
            if job.logprobs:
                choice.logprobs += update.logprobs[:used]
                tops = update.top_logprobs
                choice.top_logprobs += [()] * used if tops is None else tops[:used]
            choice.versions += update.weight_versions[:used]
            if choice.tracker.stopped_by is not None:
                choice.finish_reason, choice.stop_reason = "stop", choice.tracker.stopped_by
                await engine.finish_sample(job.request_id, update.index, "stop")
            elif update.finish_reason is not None:
                choice.finish_reason = update.finish_reason
                last = choice.token_ids[-1] if choice.token_ids else None
                if update.finish_reason == "stop" and last in stop_ids:
                    choice.stop_reason = last
            if choice.finish_reason is not None:
                choice.tracker.finish(ended_by_token=update.finish_reason == "stop")
                unfinished -= 1
            yield choice
            if unfinished == 0:
                return
    for choice in choices:  # the engine ended without finishing these (e.g. it shut down)
        if choice.finish_reason is None:
            choice.finish_reason = "abort"
            choice.tracker.finish()
            yield choice


def merge(streams: list[AsyncIterator[Choice]]) -> AsyncIterator[Choice]:
    """Interleave several prompts' choice streams as items arrive; closing the merged stream
    closes (and so aborts) every prompt still running. One stream is returned as it is: a
    streamed token passes through as few generators as possible."""
    return streams[0] if len(streams) == 1 else _interleave(streams)


async def _interleave(streams: list[AsyncIterator[Choice]]) -> AsyncIterator[Choice]:
    queue: asyncio.Queue[Choice | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Choice]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await queue.put(item)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(stream: AsyncIterator[Choice], count: int) -> list[Choice]:
    """Run a merged stream to the end; the finished choices in response order."""
    final: dict[int, Choice] = {}
    async with aclosing(stream):  # type: ignore[type-var]
        async for choice in stream:
            if choice.finish_reason is not None:
                final[choice.index] = choice
    return [final[i] for i in range(count)]
