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
releases them (POST /v1/kv/release). Between any two machines (`"p2p"`) they are sent from
those buffers over a link of the pair (engine/kv_link.py): at its first prompt for a prefill
server the decode server asks for a link (POST /v1/kv/link) and joins it in the background,
meanwhile and whenever the link is down the blocks come in bodies; once it is ready, each
staged export is sent (POST /v1/kv/send) and its receive queued one at a time per link
(`locks`), so that both sides queue the link's transfers in one order. A link that fails is dropped on both
sides (POST /v1/kv/unlink) and formed again after LINK_RETRY_S.

A prompt goes to the prefill server with the fewest prompts in flight from this server, ties
broken by its first block's tokens, so that a conversation's turns tend to meet the same
server's prefix cache.

Invariant: prefilling elsewhere never fails a request. A prefill server that cannot be reached,
answers late (`timeout_s`) or with an error, or sends blocks this engine refuses (another weight
version, another model's layout), costs the attempt's time; the prompt is then computed here, the
failure counted (`tandem_prefill_remote_failures_total`) and logged once per server and kind.
Staging buffers this server cannot map switch that prefill server to bodies.

"""

import asyncio
import base64
import contextlib
import itertools
import logging
import time
from urllib.parse import urlparse

import httpx

from tandem.inference.config import PrefillConfig
from tandem.inference.engine.api import STAGING_LEASE_S, Engine
from tandem.inference.engine.block_manager import reusable_blocks
from tandem.inference.engine.kv_prefix import packed_bytes
from tandem.inference.metrics import ServerCounters

log = logging.getLogger("tandem.inference")

LINK_RETRY_S = 60.0
"""How long after a p2p link failed a decode server asks that prefill server for a new one."""
RECEIVE_POLL_S = 0.002
"""How often a decode server asks its core whether a p2p receive is over."""


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
        # p2p, per server: its link's state ("none", "connecting", "ready", "failed"), this side's
        # number for it and the prefill server's, when a failed one may be formed again, the lock
        # that keeps one transfer at a time on it
        self.p2p = config.transport == "p2p"
        self.transfer_timeout_s = config.transfer_timeout_s
        self.link_states = ["none"] * len(self.urls)
        self.links = [0] * len(self.urls)
        self.remote_links = [0] * len(self.urls)
        self.retry_at = [0.0] * len(self.urls)
        self.locks = [asyncio.Lock() for _ in self.urls]
        self._connecting: set[asyncio.Task] = set()

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
        linked = self.p2p and self._linked(engine, k)
        body = {"prompt": ids, "skip_tokens": held, "staged": self.staged[k] or linked}
        response = await self.client.post(f"{url}/v1/kv/export", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.headers.get("content-type", "").startswith("application/octet-stream"):
            return await engine.import_prompt(ids, response.content)
        answer, staged = _staged(response)
        try:
            if linked:
                return await self._receive(engine, ids, answer, staged, k)
            return await self._map(engine, ids, staged, k)
        finally:
            release = {"buffer": staged["buffer"], "lease": answer["lease"]}
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(f"{url}/v1/kv/release", json=release)

    async def _map(self, engine: Engine, ids: list[int], staged: dict, k: int) -> int:
        """A staged export's blocks copied out of server k's mapped staging buffer and adopted."""
        try:
            return await engine.import_prompt_staged(ids, staged)
        except RuntimeError as e:  # its buffers cannot be mapped here (another machine, an invisible GPU)
            self.staged[k] = False
            log.warning(
                "prefill server %s: its staging buffers cannot be mapped here (%s); blocks come by HTTP now",
                self.urls[k],
                e,
            )
            raise

    async def _receive(self, engine: Engine, ids: list[int], answer: dict, staged: dict, k: int) -> int:
        """A staged export's blocks sent over server k's link and adopted. Only the link's own
        failures drop it: an export that is no longer held, or holds nothing, does not."""
        nbytes = packed_bytes(staged)  # (a malformed answer: nothing is sent, the link stays)
        if nbytes == 0:  # the prefill server holds no block beyond this server's
            return await engine.cached_prompt_tokens(ids)
        lease = answer["lease"]
        async with self.locks[k]:
            if self.link_states[k] != "ready":
                raise RuntimeError("the p2p link was dropped meanwhile")
            send = {
                "link": self.remote_links[k],
                "buffer": staged["buffer"],
                "lease": lease,
                "nbytes": nbytes,
            }
            try:
                response = await self.client.post(f"{self.urls[k]}/v1/kv/send", json=send)
            except httpx.HTTPError as e:  # (whether the send was queued there is unknown)
                await self._drop_link(engine, k, e)
                raise
            if response.status_code != 200:  # nothing was queued
                error = RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                if _error_param(response) != "lease":  # the link may be gone there
                    await self._drop_link(engine, k, error)
                raise error
            try:
                ticket = await engine.receive_prompt(
                    self.links[k], nbytes, lease
                )  # (queued: the next may go)
            except RuntimeError as e:  # the link failed here
                await self._drop_link(engine, k, e)
                raise
        try:
            await self._received(engine, ticket)
            return await engine.adopt_received(ticket, ids, staged)
        except RuntimeError as e:  # the transfer failed, and the link with it
            await self._drop_link(engine, k, e)
            raise

    async def _received(self, engine: Engine, ticket: int) -> None:
        """Until a queued receive is over, so that the core (which steps meanwhile) never waits
        for a slow peer; RuntimeError after twice the transfer timeout (it may have queued behind
        another transfer, each with that deadline of its own)."""
        deadline = time.monotonic() + 2 * self.transfer_timeout_s
        while not await engine.prompt_received(ticket):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a receive did not finish within {2 * self.transfer_timeout_s:g} s")
            await asyncio.sleep(RECEIVE_POLL_S)

    def _linked(self, engine: Engine, k: int) -> bool:
        """Whether server k's link is ready; starts forming it when there is none."""
        state = self.link_states[k]
        if state == "none" or (state == "failed" and time.monotonic() >= self.retry_at[k]):
            self.link_states[k] = "connecting"
            task = asyncio.create_task(self._connect(engine, k))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)
        return state == "ready"

    async def _connect(self, engine: Engine, k: int) -> None:
        url = self.urls[k]
        try:
            response = await self.client.post(f"{url}/v1/kv/link")
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            answer = response.json()
            self.remote_links[k] = int(answer["link"])
            self.links[k] = await engine.join_link(
                urlparse(url).hostname, int(answer["port"]), self.remote_links[k]
            )
            deadline = time.monotonic() + self.transfer_timeout_s
            while (state := await engine.link_state(self.links[k])) == "connecting":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the link did not form within {self.transfer_timeout_s:g} s")
                await asyncio.sleep(0.05)
            if state != "ready":
                raise RuntimeError(state)
        except Exception as e:  # noqa: BLE001 — bodies carry the blocks instead
            await self._drop_link(engine, k, e)
        else:
            self.link_states[k] = "ready"
            log.info(
                "prefill server %s: blocks come over a p2p link (its link %d)", url, self.remote_links[k]
            )

    async def _drop_link(self, engine: Engine, k: int, error: Exception) -> None:
        """End server k's link on both sides; bodies carry its blocks until LINK_RETRY_S pass."""
        self.link_states[k], self.retry_at[k] = "failed", time.monotonic() + LINK_RETRY_S
        self._warn(self.urls[k], RuntimeError(f"p2p link: {error}"))
        if self.links[k]:
            with contextlib.suppress(Exception):
                await engine.close_link(self.links[k])
        if self.remote_links[k]:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(f"{self.urls[k]}/v1/kv/unlink", json={"link": self.remote_links[k]})
        self.links[k] = self.remote_links[k] = 0

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
        for task in list(self._connecting):
            task.cancel()
        for k, remote in enumerate(self.remote_links):  # (the prefill server ends its side of the link)
            if remote:
                with contextlib.suppress(httpx.HTTPError):
                    await self.client.post(f"{self.urls[k]}/v1/kv/unlink", json={"link": remote}, timeout=2)
        await self.client.aclose()


def _error_param(response: httpx.Response) -> str | None:
    """The request field an error answer names (OpenAI's error shape), if any."""
    try:
        return response.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None


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

    def holds(self, buffer: int, lease: int) -> bool:
        """Whether `lease` still holds `buffer`."""
        return (
            0 <= buffer < len(self.leases)
            and self.leases[buffer] == lease
            and self.until[buffer] > time.monotonic()
        )

    def release(self, buffer: int, lease: int) -> bool:
        """Free `buffer` if `lease` still holds it."""
        if self.holds(buffer, lease):
            self.until[buffer] = 0.0
            return True
        return False
