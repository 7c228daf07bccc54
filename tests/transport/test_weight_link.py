"""The in-memory transports against the real native server (in-process, CPU): a transfer leaves the
server exactly as loading the same weights from disk does; an offer that does not fit is refused
with the old weights live; each side's wait ends after transfer_timeout_s with a message naming the
side and the step; a transfer that breaks off midway marks the server unusable instead of serving
mixed weights. The trainer side is a WeightSender fed by iter_hf_weights of a transformers model."""

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from server_process import serve_in_thread
from weight_link_helpers import hf, send_while, server_weights, transfer_models

from tandem.client.config import ClientConfig
from tandem.client.inference import ServerPool
from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.server import build_app
from tandem.net import free_port, is_local_address
from tandem.orchestrator.weights import PolicySync
from tandem.trainer.weight_stream import hf_weight_specs, iter_hf_weights
from tandem.transport.config import WeightsConfig
from tandem.transport.weight_link import (
    Link,
    LinkError,
    LinkSettings,
    TransferError,
    TransferRefused,
    TransferTimeout,
)
from tandem.transport.weight_sender import WeightSender
from tandem.transport.weights import write_offer

TIMEOUT_S = 3.0
PROMPT = {
    "prompt": [5, 9, 14, 20, 3],
    "max_tokens": 8,
    "temperature": 0,
    "logprobs": 1,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return transfer_models(tmp_path_factory.mktemp("models"))


@dataclass
class Linked:
    url: str
    sender: WeightSender

    def completion(self) -> dict:
        response = httpx.post(self.url + "/v1/completions", json=PROMPT, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return {"ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}

    def load(self, path: Path) -> None:
        response = httpx.post(self.url + "/update_weights", json={"path": str(path)}, timeout=60)
        assert response.status_code == 200, response.text

    def transfer(
        self, version: int, model: torch.nn.Module, dtype: torch.dtype = torch.float32, ask: bool = True
    ) -> tuple[httpx.Response | None, BaseException | None]:
        """Send `model` as `version` while (with `ask`) the server is told to receive it."""
        post = lambda: httpx.post(self.url + "/update_weights", json={"step": version}, timeout=60)  # noqa: E731
        return send_while(self.sender, version, model, post if ask else None, dtype)


@contextmanager
def linked_server(
    start: Path, transport: str, bucket_bytes: int = 512 << 20, transfer_timeout_s: float = TIMEOUT_S
) -> Iterator[Linked]:
    settings = LinkSettings("127.0.0.1", free_port(), transfer_timeout_s, 60.0, bucket_bytes)
    config = InferenceConfig.model_validate(
        {
            "model": {"name": str(start)},
            "engine": {"max_model_len": 256},
            "weights": server_weights(transport, settings),
        }
    )
    engine = AsyncEngine(config)  # its receiver joins the link in the background
    sender = WeightSender(settings, 1, 0, 1, torch.device("cpu"))
    model = hf(start)
    with serve_in_thread(build_app(engine, engine.tokenizer, config)) as url:
        sender.connect(lambda dtype: hf_weight_specs(model, dtype))
        try:
            yield Linked(url, sender)
        finally:
            sender.close()


@pytest.mark.parametrize("transport", ["broadcast", "colocated"])
def test_transfer_equals_loading_from_disk(transport: str, models: dict[str, Path]) -> None:
    with linked_server(models["a"], transport) as server:
        assert httpx.get(server.url + "/health").json()["weights"].startswith(transport)
        server.load(models["b"])
        from_disk = server.completion()
        server.load(models["a"])
        assert server.completion() != from_disk
        answer, failure = server.transfer(7, hf(models["b"]))
        assert failure is None and answer is not None and answer.json()["weight_version"] == 7, answer
        assert server.completion() == from_disk  # bit for bit: the same tensors reached the model
        answer, failure = server.transfer(8, hf(models["a"]))
        assert failure is None and answer.json()["weight_version"] == 8


def test_mismatch_is_refused_and_the_old_weights_stay_live(models: dict[str, Path]) -> None:
    with linked_server(models["a"], "broadcast") as server:
        live = server.completion()
        for model, dtype, problem in [
            (
                hf(models["wide"]),
                torch.float32,
                "model.embed_tokens.weight is [512, 128] float32, the model has [512, 256] float32",
            ),
            (hf(models["b"]), torch.float64, "is [512, 256] float64, the model has [512, 256] float32"),
        ]:
            answer, failure = server.transfer(1, model, dtype)
            assert answer is not None and answer.status_code == 400, answer.text
            message = answer.json()["error"]["message"]
            assert (
                "server 0: policy version 1 does not fit this server's model" in message
                and problem in message
            )
            assert "the old weights stay live" in message
            assert isinstance(failure, TransferRefused) and "the servers refused policy version 1" in str(
                failure
            )
            assert server.completion() == live
            assert httpx.get(server.url + "/health").json()["weight_version"] == 0
        answer, failure = server.transfer(1, hf(models["b"]))  # the link still works
        assert failure is None and answer.status_code == 200 and server.completion() != live


def test_each_side_times_out_naming_itself_and_the_step(models: dict[str, Path]) -> None:
    with linked_server(models["a"], "colocated") as server:
        live = server.completion()
        answer = httpx.post(server.url + "/update_weights", json={"step": 5}, timeout=60)
        assert answer.status_code == 504
        message = answer.json()["error"]["message"]
        assert f"server 0: policy version 5: the trainer offered nothing within {TIMEOUT_S:g} s" in message
        assert "the old weights stay live" in message and server.completion() == live

        _, failure = server.transfer(6, hf(models["b"]), ask=False)
        assert isinstance(failure, TransferTimeout)
        assert (
            f"trainer: policy version 6: server(s) 0 did not start receiving within {TIMEOUT_S:g} s"
            in str(failure)
        )
        assert server.completion() == live


class BrokenStream:
    """A trainer that crashes after its first tensors (the iterator raises)."""

    def __init__(self, model: torch.nn.Module, after: int) -> None:
        self.tensors = iter_hf_weights(model, torch.float32)
        self.left = after

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.tensors:
            if self.left == 0:
                raise RuntimeError("the trainer crashed")
            self.left -= 1
            yield item


def test_a_transfer_broken_midway_takes_the_server_out(models: dict[str, Path]) -> None:
    with linked_server(models["a"], "colocated", bucket_bytes=64 << 10) as server:
        model = hf(models["b"])
        specs = hf_weight_specs(model, torch.float32)
        failure: list[BaseException] = []

        def send() -> None:
            try:
                server.sender.send(3, specs, BrokenStream(model, after=len(specs) // 2))
            except RuntimeError as e:
                failure.append(e)

        thread = threading.Thread(target=send)
        thread.start()
        answer = httpx.post(server.url + "/update_weights", json={"step": 3}, timeout=60)
        thread.join(timeout=60)
        assert (
            failure and "the trainer crashed" in str(failure[0]) and not isinstance(failure[0], TransferError)
        )
        assert answer.status_code == 503
        message = answer.json()["error"]["message"]
        assert "server 0: policy version 3: trainer rank 0 did not fill bucket" in message
        assert "the weights now mix two versions: this server must be restarted" in message
        assert httpx.get(server.url + "/health").status_code == 503
        assert httpx.post(server.url + "/v1/completions", json=PROMPT).status_code == 503


class GatedStream:
    """The trainer's tensors, held back until `gate` opens (the transfer stays in flight)."""

    def __init__(self, model: torch.nn.Module, gate: threading.Event) -> None:
        self.tensors = iter_hf_weights(model, torch.float32)
        self.gate = gate

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.gate.wait(60), "the test never opened the gate"
        yield from self.tensors


def test_an_orchestrator_cancelled_mid_transfer_asks_once(models: dict[str, Path], tmp_path: Path) -> None:
    """The orchestrator's weight watcher is cancelled when its steps end, possibly while a server
    receives; the final wait for the last version must then wait for that transfer, not ask the
    server again for a version the trainer streams only once (the second ask would wait for an
    offer that never comes). The receive outlasts client.request_timeout: it is bounded by
    weights.transfer_timeout_s, as the server's own waits are (30 s here: the gate holds the
    stream ~2 s, which the short TIMEOUT_S of the other tests left too little room for under load)."""
    with linked_server(models["a"], "colocated", transfer_timeout_s=30.0) as server:
        model = hf(models["b"])
        gate = threading.Event()
        failure: list[BaseException] = []

        def send() -> None:
            try:
                specs = hf_weight_specs(model, torch.float32)
                server.sender.send(1, specs, GatedStream(model, gate), lambda v: write_offer(tmp_path, v))
            except BaseException as e:  # noqa: BLE001 — asserted below
                failure.append(e)

        async def orchestrator() -> int:
            pool = ServerPool([server.url], ClientConfig(max_retries=0, request_timeout=1.0))
            policy = PolicySync(tmp_path, pool, WeightsConfig(transport="colocated", poll_interval=0.01))
            watcher = asyncio.ensure_future(policy.watch())
            store = Link(server.sender.settings, "test", master=False).store  # a client of its own
            while not store.check(["ready/1/0"]):  # the server accepted: its request is in flight
                await asyncio.sleep(0.01)
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await asyncio.sleep(1.5)  # longer than request_timeout
            gate.set()
            await policy.wait_for(1, step=1, max_async_level=0)
            await pool.close()
            return policy.version

        thread = threading.Thread(target=send)
        thread.start()
        assert asyncio.run(orchestrator()) == 1
        thread.join(timeout=60)
        assert not failure, failure
        assert httpx.get(server.url + "/health").json()["weight_version"] == 1
        assert "tandem_weight_updates_total 1\n" in httpx.get(server.url + "/metrics").text


def test_rank_0_away_from_the_stores_address_fails_at_once() -> None:
    """On several nodes rank 0 hosts the store at the first trainer host's address; torchrun may
    put rank 0 on another node, where a TCPStore would still start (it listens on every address of
    its machine) and the servers wait connect_timeout_s at an address where nothing listens."""
    assert is_local_address("127.0.0.1") and is_local_address("localhost") and is_local_address("0.0.0.0")
    away = "192.0.2.1"  # TEST-NET-1: no machine's own address
    assert not is_local_address(away)
    settings = LinkSettings(away, free_port(), TIMEOUT_S, 900.0)
    with pytest.raises(
        LinkError, match=r"trainer: rank 0 hosts the weight group's store at 192\.0\.2\.1:\d+, but"
    ):
        Link(settings, "trainer", master=True)
    link = Link(LinkSettings("127.0.0.1", free_port(), TIMEOUT_S, 60.0), "trainer", master=True)
    link.put("k", "v")
    assert link.get("k") == b"v"
