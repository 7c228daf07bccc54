"""Shared by the weight-transport tests: tiny models to send, and one in-memory update driven from
both sides (a WeightSender in a thread, the server told to receive by the test)."""

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from tandem.models.tiny import build_tiny_model
from tandem.trainer.weight_stream import hf_weight_specs, iter_hf_weights
from tandem.transport.weight_link import LinkSettings
from tandem.transport.weight_sender import WeightSender


def transfer_models(root: Path) -> dict[str, Path]:
    """`a` (what the servers start from), `b` (other weights, same shapes), `wide` (other shapes)."""
    return {
        "a": build_tiny_model(out=root / "a", seed=0),
        "b": build_tiny_model(out=root / "b", seed=1),
        "wide": build_tiny_model(out=root / "wide", hidden_size=128, head_dim=32, intermediate_size=256),
    }


def server_weights(transport: str, link: LinkSettings) -> dict:
    """The `[weights]` section of a server that joins the trainer's link at `link` (the engine
    builds its receiver from it)."""
    return {
        "transport": transport,
        "host": link.host,
        "port": link.port,
        "transfer_timeout_s": link.transfer_timeout_s,
        "connect_timeout_s": link.connect_timeout_s,
    }


def hf(path: Path, device: str = "cpu") -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def send_while(
    sender: WeightSender,
    version: int,
    model: torch.nn.Module,
    ask: Callable[[], httpx.Response] | None,
    dtype: torch.dtype | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> tuple[httpx.Response | None, BaseException | None]:
    """Send `model` as `version` while `ask()` tells the server to receive it (None: nobody asks);
    the server's answer and the sender's error, if any. `tensors`: what to stream instead of the
    model's tensors (fewer: a trainer that fails midway)."""
    dtype = dtype or sender.dtype
    failure: list[BaseException] = []

    def send() -> None:
        try:
            stream = iter_hf_weights(model, dtype) if tensors is None else tensors
            sender.send(version, hf_weight_specs(model, dtype), stream)
        except BaseException as e:  # returned to the test
            failure.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    answer = ask() if ask is not None else None
    thread.join(timeout=120)
    assert not thread.is_alive(), "the sender did not return"
    return answer, failure[0] if failure else None
