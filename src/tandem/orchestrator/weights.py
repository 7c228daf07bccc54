"""Policy versions: keep every server on the newest published weights, and gate steps on them.

With `transport = filesystem` the trainer publishes policy version N as `run_dir/weights/step_N/`
and writes `STABLE` into it last; the servers are told to load the newest such directory. With an
in-memory transport the trainer offers version N (`run_dir/weights/OFFERED`) and waits; the
servers are told to receive it (`{"step": N}`), and the trainer streams it to them. Either way
this class decides when a server changes weights. Version 0 is the initial model the servers start
with. Rollouts for step N may only be generated once the servers serve a version >= N -
max_async_level (docs/async.md).
"""

import asyncio
import logging
import time
from pathlib import Path

from tandem.cli import UserError
from tandem.client.inference import RequestRejected, ServerPool
from tandem.orchestrator.config import WeightsConfig
from tandem.transport.weights import STABLE, latest_version, offer_path, offered_version, weights_dir

log = logging.getLogger(__name__)


class WeightsTimeout(UserError):
    """The weights a step needs did not appear in time."""


class PolicySync:
    """Tracks the version every server serves; loads newer published weights onto all of them."""

    def __init__(self, run_dir: Path, pool: ServerPool, cfg: WeightsConfig, version: int = 0) -> None:
        self.run_dir = run_dir
        self.pool = pool
        self.cfg = cfg
        self.version = version
        self.lock = asyncio.Lock()
        self.moving: asyncio.Future[None] | None = None  # the servers' move to a newer version

    def available(self) -> int | None:
        """The newest version the trainer has made available."""
        if self.cfg.in_memory:
            return offered_version(self.run_dir)
        return latest_version(self.run_dir)

    def marker(self, version: int) -> Path:
        """The file whose appearance makes `version` available (named in timeouts)."""
        return offer_path(self.run_dir) if self.cfg.in_memory else weights_dir(self.run_dir, version) / STABLE

    async def sync(self) -> int:
        """Move every server to the newest available version if it is newer; returns the version.

        The move itself is shielded: a caller cancelled while the servers receive (the weight
        watcher, stopped when the steps end) leaves it running, and the next `sync` waits for that
        move instead of asking again. Asking twice would be wrong for an in-memory version: the
        trainer streams it once, so a second request would wait for an offer that never comes. A
        move that failed with nobody waiting raises its error at the next `sync`."""
        async with self.lock:
            if self.moving is None or (self.moving.done() and self.moving.exception() is None):
                latest = self.available()
                if latest is None or latest <= self.version:
                    return self.version
                self.moving = asyncio.ensure_future(self.move(latest))
            await asyncio.shield(self.moving)
            return self.version

    async def move(self, latest: int) -> None:
        start = time.perf_counter()
        try:
            if self.cfg.in_memory:
                source = f"the {self.cfg.transport} transport"
                # the server waits up to transfer_timeout_s for the offer, then as long for the
                # transfer; its drain of running requests comes first
                seconds = 2 * self.cfg.transfer_timeout_s + self.pool.cfg.request_timeout
                settings = "2 × weights.transfer_timeout_s + client.request_timeout"
                served = await self.pool.receive_weights(latest, (seconds, settings))
            else:
                source = str(weights_dir(self.run_dir, latest))
                served = await self.pool.update_weights(weights_dir(self.run_dir, latest))
        except RequestRejected as e:
            raise UserError(f"the servers could not load policy version {latest}: {e}") from None
        if any(v != latest for v in served):
            raise UserError(
                f"servers report weight versions {served} after loading {source}; expected {latest} "
                "(the server must take the policy version from the weights directory)"
            )
        log.info("servers now serve policy version %d (%.2fs)", latest, time.perf_counter() - start)
        self.version = latest

    async def wait_for(self, version: int, step: int, max_async_level: int) -> float:
        """Block until the servers serve `version` or newer; returns seconds waited."""
        start = time.perf_counter()
        while (await self.sync()) < version:
            waited = time.perf_counter() - start
            if waited > self.cfg.wait_timeout:
                raise WeightsTimeout(
                    f"waited {waited:.0f}s for {self.marker(version)}: step {step} "
                    f"needs policy version >= {version} (max_async_level {max_async_level}); is the trainer running?"
                )
            await asyncio.sleep(self.cfg.poll_interval)
        return time.perf_counter() - start

    async def watch(self) -> None:
        """Forever: push newly published weights to the servers as soon as STABLE appears."""
        while True:
            await self.sync()
            await asyncio.sleep(self.cfg.poll_interval)
