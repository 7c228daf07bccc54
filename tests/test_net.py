"""Port pickers stay below the kernel's ephemeral range, where outgoing connections take ports."""

import socket

from tandem.net import LOWEST, ephemeral_start, free_port, free_ports


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    top = ephemeral_start()
    picked = {free_port() for _ in range(20)}
    assert len(picked) > 1  # drawn at random, not the same port each time
    base = free_ports(8)
    for port in [*picked, *range(base, base + 8)]:
        assert LOWEST <= port < top
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ephemeral_start_reads_the_kernels_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert ephemeral_start() == int(f.read().split()[0])
