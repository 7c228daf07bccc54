"""Prefill on other servers (prefill/decode disaggregation), the HTTP sides of it.

A decode server (`[inference.prefill] servers`, `PrefillServers`) has the prompts it serves
computed by other tandem servers: for a prompt with at least `min_tokens` tokens beyond what its
own prefix cache holds, it asks a prefill server for the prompt's keys and values (POST
/v1/kv/export, which computes the prompt there and answers the blocks this server lacks;
engine/kv_prefix.py), takes them into its prefix cache, and then generates as usual: the prompt
is a prefix-cache hit but for its last (at most one block of) tokens. Long prompts then stop
taking decode steps' time here: a decode step that shares the device with a prefill chunk waits
for it. The blocks come in the answer's body (`transport = "http"`) or, between servers of one
machine, through the prefill server's staging buffers (`"shared"`: engine/kv_staging.py), which
the prefill server lends one export at a time (`StagingLeases`) until the decode server
releases them (POST /v1/kv/release).

A prompt goes to the prefill server with the fewest prompts in flight from this server, ties
broken by its first block's tokens, so that a conversation's turns tend to meet the same
server's prefix cache.

Invariant: prefilling elsewhere never fails a request. A prefill server that cannot be reached,
answers late (`timeout_s`) or with an error, or sends blocks this engine refuses (another weight
version, another model's layout), costs the attempt's time; the prompt is then computed here, the
failure counted (`tandem_prefill_remote_failures_total`) and logged once per server and kind.
Staging buffers this server cannot map switch that prefill server to bodies.

Between machines the bodies pass through host memory and TCP: a stand-in for a network transfer
of the blocks (NCCL, as weights travel), not built yet (docs/inference-engine.md).
"""

import asyncio
import base64
import contextlib
import itertools
import logging
import time

import httpx

from tandem.inference.config import PrefillConfig
from tandem.inference.engine.api import STAGING_LEASE_S, Engine
from tandem.inference.engine.block_manager import reusable_blocks
from tandem.inference.metrics import ServerCounters

log = logging.getLogger("tandem.inference")


class PrefillServers:
    """This server's prefill servers, and the prompts in flight to each."""

    def __init__(
        self, config: PrefillConfig, block_size: int, api_key: str | None, counters: ServerCounters
    ) -> None:
        self.urls = config.servers
        self.min_tokens = config.min_tokens
        self.block_size = block_size
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.AsyncClient(
            timeout=config.timeout_s, headers=headers, limits=httpx.Limits(max_connections=None)
        )
        self.in_flight = [0] * len(self.urls)
        self.staged = [config.transport == "shared"] * len(self.urls)  # per server: staging buffers work
        self.counters = counters
        self._warned: set[tuple[str, str]] = set()

    async def prefill(self, engine: Engine, prompts: list[list[int]]) -> None:
        """Have the prompts that are worth it computed elsewhere, all at once; never raises."""
        await asyncio.gather(*(self._prefill(engine, ids) for ids in prompts))

    async def _prefill(self, engine: Engine, ids: list[int]) -> None:
        if reusable_blocks(len(ids), self.block_size) * self.block_size < self.min_tokens:
            return
        held = await engine.cached_prompt_tokens(ids)
        if len(ids) - held < self.min_tokens:
            return
        k = self._pick(ids)
        url = self.urls[k]
        self.in_flight[k] += 1
        start = asyncio.get_running_loop().time()
        try:
            cached = await self._fetch(engine, ids, held, k)
        except Exception as e:  # noqa: BLE001 — whatever went wrong there, the prompt is computed here
            self.counters.prefill_remote_failures_total += 1
            self._warn(url, e)
        else:
            self.counters.prefill_remote_prompts_total += 1
            self.counters.prefill_remote_tokens_total += max(
                0, cached - held
            )  # (held blocks may go meanwhile)
        finally:
            self.in_flight[k] -= 1
            self.counters.prefill_remote_seconds_total += asyncio.get_running_loop().time() - start

    async def _fetch(self, engine: Engine, ids: list[int], held: int, k: int) -> int:
        """Prompt `ids` computed by prefill server k and adopted; the prompt tokens now cached."""
        url = self.urls[k]
        body = {"prompt": ids, "skip_tokens": held, "staged": self.staged[k]}
        response = await self.client.post(f"{url}/v1/kv/export", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.headers.get("content-type", "").startswith("application/octet-stream"):
            return await engine.import_prompt(ids, response.content)
        answer, staged = _staged(response)
        try:
            return await engine.import_prompt_staged(ids, staged)
        except RuntimeError as e:  # its buffers cannot be mapped here (another machine, an invisible GPU)
            self.staged[k] = False
            log.warning(
                "prefill server %s: its staging buffers cannot be mapped here (%s); blocks come by HTTP now",
                url,
                e,
            )
            raise
        finally:
            release = {"buffer": staged["buffer"], "lease": answer["lease"]}
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(f"{url}/v1/kv/release", json=release)

    def _pick(self, ids: list[int]) -> int:
        """The least busy prefill server; among equals, the one the prompt's first block names."""
        least = min(self.in_flight)
        candidates = [k for k, count in enumerate(self.in_flight) if count == least]
        return candidates[hash(tuple(ids[: self.block_size])) % len(candidates)]

    def _warn(self, url: str, error: Exception) -> None:
        kind = type(error).__name__
        if (url, kind) not in self._warned:
            self._warned.add((url, kind))
            log.warning(
                "prefill server %s failed (%s: %s); such prompts are computed here (logged once per kind)",
                url,
                kind,
                error,
            )

    async def close(self) -> None:
        """Log what the prefill servers did for this server, and close the connections."""
        c = self.counters
        log.info(
            "prefill servers computed %d prompt(s) for this server (%d tokens taken into its cache, "
            "%.1f s waited); %d attempt(s) fell back to computing here",
            c.prefill_remote_prompts_total,
            c.prefill_remote_tokens_total,
            c.prefill_remote_seconds_total,
            c.prefill_remote_failures_total,
        )
        await self.client.aclose()


def _staged(response: httpx.Response) -> tuple[dict, dict]:
    """A staged answer and where its blocks lie (the handle decoded, the time it came); ValueError
    for anything else."""
    try:
        answer = response.json()
        staged = answer["staged"]
        return answer, {**staged, "handle": base64.b64decode(staged["handle"]), "received": time.monotonic()}
    except (ValueError, KeyError, TypeError) as e:  # (binascii.Error is a ValueError)
        raise ValueError(f"a malformed staged answer: {e!r}") from None


class StagingLeases:
    """A prefill server's staging buffers (engine/kv_staging.py), each lent to one export at a time
    until the decode server releases it or STAGING_LEASE_S pass."""

    def __init__(self, count: int) -> None:
        self.until = [0.0] * count  # time.monotonic() when each buffer is free again
        self.leases = [0] * count
        self._ids = itertools.count(1)

    def lend(self) -> tuple[int, int] | None:
        """(buffer, lease) of a free buffer, now lent; None when all are lent."""
        now = time.monotonic()
        for buffer, until in enumerate(self.until):
            if until <= now:
                self.until[buffer], self.leases[buffer] = now + STAGING_LEASE_S, next(self._ids)
                return buffer, self.leases[buffer]
        return None

    def release(self, buffer: int, lease: int) -> bool:
        """Free `buffer` if `lease` still holds it."""
        if 0 <= buffer < len(self.leases) and self.leases[buffer] == lease and self.until[buffer]:
            self.until[buffer] = 0.0
            return True
        return False
