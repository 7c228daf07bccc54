"""Port pickers stay out of the kernel's ephemeral range, where outgoing connections take ports."""

import socket

from tandem.net import ephemeral_range, free_port, free_ports, picking_range


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    picked = {free_port() for _ in range(20)}
    assert len(picked) > 1  # drawn at random, not the same port each time
    base = free_ports(8)
    for port in [*picked, *range(base, base + 8)]:
        assert port in picking_range() and not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ephemeral_range_is_the_kernels() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert ephemeral_range() == tuple(map(int, f.read().split()))
