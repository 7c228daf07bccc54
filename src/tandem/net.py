"""Free TCP ports for a server about to be started (a run's weight group, a test's or an
evaluation's inference server), and whether a host is this machine.

Both helpers race: a port found free here is released before its server binds it, so another
process may take it in between. They suit a server started right after, on a machine where little
else picks ports; a caller that must be sure binds port 0 itself and reads the port back.
"""

import random
import socket

WILDCARD = ("0.0.0.0", "::", "")
"""Hosts that mean every address of this machine."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` the kernel just gave out for port 0 (from the ephemeral range, 32768 and up
    on Linux), free now but not held."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int = 8, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports of `host` free now, for a run whose N servers listen
    at inference.port … inference.port + N - 1. They are picked below Linux's ephemeral range
    (32768 and up), where the kernel gives out ports to client sockets: a port above it, free now,
    can be taken by any outgoing connection (a test running beside) before its server binds it."""
    for _ in range(200):
        base = random.randrange(20000, 32768 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports below 32768")


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
