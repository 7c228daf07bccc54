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
        transfers = [prefill.get(p).send(t, tag) for tag, t in enumerate(payloads, 7)]  # before any receive
        receives = [
            decode.get(d).receive(t.numel(), tag) for tag, t in enumerate(payloads, 7)
        ]  # before any wait
        for payload, receive in zip(payloads, receives, strict=True):
            assert torch.equal(decode.get(d).wait(receive), payload)
        for transfer in transfers:
            assert transfer.done.wait(5) and transfer.error is None
        with pytest.raises(ValueError, match="kv link 99 does not exist here"):
            decode.get(99)  # (numbers are random up to 2**52: a small one is never taken)
    finally:
        prefill.close_all()
        decode.close_all()


def test_a_receive_without_a_send_fails_the_link_by_its_deadline() -> None:
    prefill, p, decode, d = linked_pair(timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="a recv of 8 bytes failed"):
            decode.get(d).wait(decode.get(d).receive(8, 1))
        assert time.monotonic() - start < 10
        assert decode.get(d).state.startswith("failed")
        with pytest.raises(RuntimeError, match="is failed"):
            decode.get(d).receive(8, 2)
    finally:
        prefill.close_all()
        decode.close_all()


@pytest.mark.parametrize("wrong", ["tag", "size"])
def test_a_pair_out_of_step_fails_the_link_instead_of_adopting_the_bytes(wrong: str) -> None:
    """The receiver expects export 5's 100 bytes; the peer sends another export's, or more of
    them (gloo would complete a receive from a shorter or longer send without complaint)."""
    prefill, p, decode, d = linked_pair(timeout_s=2.0)  # (the unreceived payload fails at its deadline)
    try:
        sent = prefill.get(p).send(
            torch.ones(120 if wrong == "size" else 100, dtype=torch.uint8), 6 - (wrong == "size")
        )
        with pytest.raises(RuntimeError, match="out of step with the peer: expected 100 bytes of export 5"):
            decode.get(d).wait(decode.get(d).receive(100, 5))
        assert decode.get(d).state.startswith("failed: out of step")
        assert sent.done.wait(10) and sent.error is not None  # (its payload was never received: its deadline)
        reopened = prefill.open()  # opening a link reaps the failed ones
        assert p not in prefill.links or prefill.get(p).error is None
        assert reopened["link"] != p
    finally:
        prefill.close_all()
        decode.close_all()


def test_an_idle_prefill_side_is_closed_when_the_next_link_opens() -> None:
    """A decode side that vanishes without closing (a killed decode server) leaves its prefill
    side idle: the next link to open closes it once it has been idle for `idle_s`, and keeps a
    side used more recently than that; the decode server's new link then forms at once, though
    another side still waits for a peer that never joined (each side has its own store client)."""
    prefill, p, decode, d = linked_pair()
    try:
        first_decode = decode.links.pop(d)  # this decode "process" is gone: nothing closes its side
        never_joined = prefill.open()["link"]  # its side waits for a peer (until its group's timeout)
        assert p in prefill.links  # idle for less than idle_s (600 s)
        time.sleep(0.05)
        prefill.idle_s = 0.01
        opened = prefill.open()
        assert p not in prefill.links and never_joined not in prefill.links
        assert set(prefill.links) == {opened["link"]}
        joined = decode.join("127.0.0.1", opened["port"], opened["link"])
        deadline = time.monotonic() + 10
        while "connecting" in (prefill.get(opened["link"]).state, decode.get(joined).state):
            assert time.monotonic() < deadline, "the new link did not form"
            time.sleep(0.01)
        payload = torch.arange(10, dtype=torch.uint8)
        prefill.get(opened["link"]).send(payload, 3)
        assert torch.equal(decode.get(joined).wait(decode.get(joined).receive(10, 3)), payload)
        first_decode.close()
    finally:
        prefill.close_all()
        decode.close_all()
