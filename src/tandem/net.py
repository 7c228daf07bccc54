"""Free TCP ports for a server about to be started (a run's weight group, a test's or an
evaluation's inference server), and whether a host is this machine.

The port pickers race: a port found free here is released before its server binds it, so another
process may take it in between. They pick outside the kernel's ephemeral range, which narrows the
race to other pickers: a port above it can be given to any outgoing connection (an HTTP client, a
test running beside) before its server binds it, and a client connecting to such a port before its
server listens can even connect to itself (TCP simultaneous open) and wait on its own socket.
A caller that must be sure binds port 0 itself and reads the port back.
"""

import random
import socket
from pathlib import Path

WILDCARD = ("0.0.0.0", "::", "")
"""Hosts that mean every address of this machine."""

LOWEST = 20000
"""Ports are picked from here up to the start of the ephemeral range (or above its end, where a
machine's range starts lower)."""


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives out to client sockets (Linux's ip_local_port_range; 32768-60999,
    Linux's default, where the file is missing)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def picking_range() -> range:
    """Where free ports are picked: below the ephemeral range, else above it, else (a machine
    whose range covers nearly everything) from LOWEST on anyway."""
    low, high = ephemeral_range()
    if low - LOWEST >= 1000:
        return range(LOWEST, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return range(LOWEST, LOWEST + 1000)


def free_ports(count: int = 8, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports of `host` free now (for a run whose N servers listen
    at inference.port … inference.port + N - 1), picked at random outside the ephemeral range."""
    ports = picking_range()
    for _ in range(200):
        base = random.randrange(ports.start, ports.stop - count + 1)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports of {host} in {ports.start}..{ports.stop - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port of `host` free now, outside the ephemeral range."""
    return free_ports(1, host)


def is_local_address(host: str) -> bool:
    """Whether `host` names an address of this machine (one a socket can bind); an unresolvable
    name counts as local (binding or connecting to it then says what is wrong with it)."""
    if host in WILDCARD:
        return True
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return True
    for family, kind, _, _, address in addresses:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False
