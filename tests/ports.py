"""Ports for the servers that tests start (``gpufleet up``, API, controller, agents).

A port found by binding port 0 and closing the socket comes from the kernel's ephemeral range,
the same range every outgoing connection's local port is drawn from: between the probe and the
server's own bind, a database, Redis or gRPC client connection of any test process may take it
(the fresh-clone CI once failed so: ``gpufleet up`` could not bind 127.0.0.1:54524). These ports
come from below (else above) ``/proc/sys/net/ipv4/ip_local_port_range`` instead, where the
kernel never puts a connection, in a slice of their own per pytest-xdist worker, handed out in
turn (a bind test skips a port still taken). Where the range leaves no room, the old way.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from pathlib import Path

SLICE = 1_000
"""Ports per xdist worker."""
SLICES = 8
"""Workers with a slice of their own; worker k uses slice k mod SLICES."""
LOWEST = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _worker_slice() -> range | None:
    lo, hi = _ephemeral_range()
    if lo - SLICE * SLICES >= LOWEST:
        base = lo - SLICE * SLICES
    elif hi + 1 + SLICE * SLICES <= 65535:
        base = hi + 1
    else:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    k = int(worker) % SLICES if worker.isdigit() else 0
    return range(base + k * SLICE, base + (k + 1) * SLICE)


_SLICE = _worker_slice()
_next = itertools.cycle(_SLICE) if _SLICE is not None else None
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no connection is given meanwhile."""
    if _next is None:
        return _kernel_port()
    with _lock:
        for _ in range(SLICE):
            port = next(_next)
            if _bindable(port):
                return port
    raise AssertionError(f"no free port in {_SLICE}")


def free_port_pair() -> int:
    """A port p with p and p + 1 free (a controller and its join service)."""
    for _ in range(SLICE):
        port = free_port()
        if port < 65535 and _bindable(port + 1):
            if _next is not None:
                with _lock:
                    next(_next)  # (p + 1 is the pair's: not handed out next)
            return port
    raise AssertionError("no two adjacent free ports")
