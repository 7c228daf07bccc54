"""Prompts moved between engines (prefill on other servers): the engine core's side.

A prefill server's core exports the keys and values of a prompt it computed (kv_prefix.py), as
bytes or packed into one of its staging buffers (kv_staging.py), which a decode server's core
maps (one machine) or receives over a link (kv_link.py, any two machines); the decode server's
core adopts them into its own prefix cache. These are the methods the fronts reach through `core` calls
(api.py `EngineFront`); EngineCore (core.py) inherits them, and provides `blocks`, `runner`,
`weight_version` and `device`.
"""

import itertools

import torch

from tandem.inference.config import PrefillConfig
from tandem.inference.engine import kv_prefix
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.kv_link import KVLinks, Transfer
from tandem.inference.engine.kv_staging import OpenedStaging, StagingBuffers
from tandem.inference.engine.model_runner import ModelRunner


class PromptTransfer:
    blocks: BlockManager
    runner: ModelRunner
    weight_version: int
    device: torch.device

    def init_prompt_transfer(self, prefill: PrefillConfig) -> None:
        """As a prefill server: staging buffers to lend; as a decode server: other servers' mapped."""
        self.staging = StagingBuffers(prefill.staging_buffers, prefill.staging_mb << 20, self.device)
        self.opened_staging = OpenedStaging()
        self.links = KVLinks(self.device, prefill.transfer_timeout_s)
        self.receiving: dict[int, tuple[int, Transfer]] = {}  # ticket → (link, its queued receive)
        self._tickets = itertools.count(1)

    def cached_prompt_tokens(self, token_ids: list[int]) -> int:
        """Tokens at the start of a prompt that the prefix cache holds and would reuse."""
        return kv_prefix.cached_tokens(self.blocks, token_ids)

    def export_prompt(self, token_ids: list[int], skip_tokens: int) -> bytes:
        """The cached keys and values of a prompt's reusable blocks after `skip_tokens`, as bytes."""
        return kv_prefix.to_bytes(self._export(token_ids, skip_tokens))

    def export_prompt_staged(self, token_ids: list[int], skip_tokens: int, buffer: int) -> dict:
        """The same packed into staging buffer `buffer`; where it lies (kv_staging.py)."""
        return self.staging.stage(self._export(token_ids, skip_tokens), buffer)

    def import_prompt(self, token_ids: list[int], data: bytes) -> int:
        """Adopt a prefill server's export for this prompt; returns the prompt tokens now cached."""
        return self._adopt(token_ids, kv_prefix.from_bytes(data))

    def import_prompt_staged(self, token_ids: list[int], staged: dict) -> int:
        """Adopt a prefill server's staged export; returns once the copies out of its buffer are
        done, so that the buffer can be released."""
        prefix = self.opened_staging.prefix(staged)
        cached = self._adopt(token_ids, prefix)
        if self.device.type == "cuda":  # (the peer copy may run on either GPU's stream)
            for device in {self.device, *(part.device for part in prefix.parts)}:
                torch.cuda.synchronize(device)
        return cached

    def open_link(self) -> dict:
        """As a prefill server: a link for a decode server, waiting for it to join (kv_link.py)."""
        return self.links.open()

    def join_link(self, host: str, port: int, link: int) -> int:
        """As a decode server: join a prefill engine's link; this side's number for it."""
        return self.links.join(host, port, link)

    def link_state(self, number: int) -> str:
        """ "ready", "connecting" or "failed: why"."""
        return self.links.get(number).state

    def close_link(self, number: int) -> None:
        self.links.close(number)
        for ticket in [t for t, (n, _) in self.receiving.items() if n == number]:
            del self.receiving[ticket]

    def send_staged(self, number: int, buffer: int, nbytes: int, lease: int) -> None:
        """As a prefill server: queue the first `nbytes` of staging buffer `buffer` (the packed
        blocks of the export that `lease` holds) on link `number`."""
        self.staging.send(self.links.get(number), buffer, nbytes, lease)

    def receive_prompt(self, number: int, nbytes: int, lease: int) -> int:
        """As a decode server: queue the receive of the `nbytes` the prefill engine queued on link
        `number` for export `lease` (`send_staged`); a ticket for `adopt_received`."""
        ticket = next(self._tickets)
        self.receiving[ticket] = (number, self.links.get(number).receive(nbytes, lease))
        return ticket

    def prompt_received(self, ticket: int) -> bool:
        """Whether a queued receive is over (done or failed): `adopt_received` then waits for nothing."""
        return self.receiving[ticket][1].done.is_set()

    def adopt_received(self, ticket: int, token_ids: list[int], staged: dict) -> int:
        """Wait for a queued receive (the core waits: ask `prompt_received` first) and adopt its
        blocks (a staged export's: `staged` says where they lie); the prompt tokens now cached."""
        number, transfer = self.receiving.pop(ticket)
        received = self.links.get(number).wait(transfer)
        cached = self._adopt(token_ids, kv_prefix.unpack(staged, received))
        if self.device.type == "cuda":  # (the received buffer is freed on return)
            torch.cuda.current_stream(self.device).synchronize()
        return cached

    def close_staging(self) -> None:
        """Free the staging buffers, unmap other servers' (shared memory outlives a process), and
        end the links."""
        self.staging.close()
        self.opened_staging.close()
        self.links.close_all()

    def _export(self, token_ids: list[int], skip_tokens: int) -> kv_prefix.Prefix:
        cache = self.runner.kv_cache
        return kv_prefix.export_prefix(self.blocks, cache, self.weight_version, token_ids, skip_tokens)

    def _adopt(self, token_ids: list[int], prefix: kv_prefix.Prefix) -> int:
        return kv_prefix.adopt_prefix(
            self.blocks, self.runner.kv_cache, self.weight_version, token_ids, prefix
        )
