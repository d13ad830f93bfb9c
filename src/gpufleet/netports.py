"""Choosing a TCP port for a server that another process starts a moment later.

Binding port 0, reading the port and closing the socket finds a port in the kernel's
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), the range every outgoing
connection's local port is drawn from: before the server binds it, any connection of the
machine (a database, an agent's gRPC channel, NCCL) may take it and the server fails with
"address already in use". A port below that range (else above it) is never given to a
connection by the kernel, so ``free_port`` probes there, from a random start, and returns the
first port it can bind: only another listener that started meanwhile can still take it.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

LOWEST = 10_000
"""No port below this is probed (the well-known and registered services live there)."""
SPAN = 8_000
"""Ports probed, next to the ephemeral range."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for connections' local ports, inclusive (Linux's default where
    ``/proc`` does not say)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def outside_ephemeral(span: int = SPAN) -> range | None:
    """``span`` ports just below the ephemeral range (else just above it); None when neither
    side has room."""
    lo, hi = ephemeral_range()
    if lo - span >= LOWEST:
        return range(lo - span, lo)
    if hi + 1 + span <= 65536:
        return range(hi + 1, hi + 1 + span)
    return None


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound (TCP) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def kernel_port(host: str = "127.0.0.1") -> int:
    """A port the kernel chooses (ephemeral: see the module docstring)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1", candidates: Iterable[int] | None = None) -> int:
    """A port of ``host`` free now, outside the ephemeral range (``candidates`` in order, else
    from a random point of ``outside_ephemeral()``); the kernel's choice when none is free or
    the range leaves no room."""
    if candidates is None:
        ports = outside_ephemeral()
        if ports is None:
            return kernel_port(host)
        start = random.randrange(len(ports))
        candidates = (ports[(start + k) % len(ports)] for k in range(len(ports)))
    for port in candidates:
        if bindable(port, host):
            return port
    return kernel_port(host)
