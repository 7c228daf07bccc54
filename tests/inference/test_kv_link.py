"""kv links (engine/kv_link.py) on CPU: the two sides of a pair, each with its own gloo group and
thread, here in one process; a real TCPStore on 127.0.0.1."""

import time

import pytest
import torch

from tandem.inference.engine.kv_link import KVLinks


def linked_pair(timeout_s: float = 5.0) -> tuple[KVLinks, int, KVLinks, int]:
    prefill, decode = KVLinks(torch.device("cpu"), timeout_s), KVLinks(torch.device("cpu"), timeout_s)
    opened = prefill.open()
    joined = decode.join("127.0.0.1", opened["port"], opened["link"])
    deadline = time.monotonic() + 10
    while "connecting" in (prefill.get(opened["link"]).state, decode.get(joined).state):
        assert time.monotonic() < deadline, "the link did not form"
        time.sleep(0.01)
    assert prefill.get(opened["link"]).state == decode.get(joined).state == "ready"
    return prefill, opened["link"], decode, joined


def test_transfers_arrive_in_order_and_in_full() -> None:
    """Four sends queued before any receive, then four receives queued before any wait."""
    prefill, p, decode, d = linked_pair()
    try:
        payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (3, 1000, 17, 65536)]
        transfers = [prefill.get(p).send(t) for t in payloads]  # all queued before any receive
        receives = [decode.get(d).receive(t.numel()) for t in payloads]  # all queued before any wait
        for payload, receive in zip(payloads, receives, strict=True):
            assert torch.equal(decode.get(d).wait(receive), payload)
        for transfer in transfers:
            assert transfer.done.wait(5) and transfer.error is None
        with pytest.raises(ValueError, match="kv link 99 does not exist here"):
            decode.get(99)
    finally:
        prefill.close_all()
        decode.close_all()


def test_a_receive_without_a_send_fails_the_link_by_its_deadline() -> None:
    prefill, p, decode, d = linked_pair(timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="a recv of 8 bytes failed"):
            decode.get(d).wait(decode.get(d).receive(8))
        assert time.monotonic() - start < 10
        assert decode.get(d).state.startswith("failed")
        with pytest.raises(RuntimeError, match="is failed"):
            decode.get(d).receive(8)
    finally:
        prefill.close_all()
        decode.close_all()
