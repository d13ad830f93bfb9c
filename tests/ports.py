"""Ports for the servers that tests start (``gpufleet up``, API, controller, agents).

A port found by binding port 0 lies in the kernel's ephemeral range, where any test
process's outgoing connection may take it before the server binds it (the fresh-clone CI once
failed so: ``gpufleet up`` could not bind 127.0.0.1:54524). As in ``gpufleet.netports``, these
come from outside that range; here each pytest-xdist worker has a slice of its own and hands
its ports out in turn from a random point of it, so two workers never probe the same port, a
worker does not reuse one soon, and two test sessions on one machine rarely meet (a bind test
skips a port still taken).
"""

from __future__ import annotations

import itertools
import os
import random
import threading

from gpufleet.netports import bindable, kernel_port, outside_ephemeral

SLICES = 8
"""Workers with a slice of their own; worker k uses slice k mod SLICES."""


def _worker_slice() -> range | None:
    ports = outside_ephemeral()
    if ports is None:
        return None
    size = len(ports) // SLICES
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    k = int(worker) % SLICES if worker.isdigit() else 0
    return range(ports.start + k * size, ports.start + (k + 1) * size)


_SLICE = _worker_slice()
_next: itertools.cycle[int] | None = None
if _SLICE is not None:
    _start = random.randrange(len(_SLICE))
    _next = itertools.cycle((*_SLICE[_start:], *_SLICE[:_start]))
_lock = threading.Lock()


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no connection is given meanwhile."""
    if _next is None or _SLICE is None:
        return kernel_port()
    with _lock:
        for _ in range(len(_SLICE)):
            port = next(_next)
            if bindable(port):
                return port
    raise AssertionError(f"no free port in {_SLICE}")


def free_port_pair() -> int:
    """A port p with p and p + 1 free (a controller and its join service)."""
    for _ in range(1000):
        port = free_port()
        if port < 65535 and bindable(port + 1):
            if _next is not None:
                with _lock:
                    next(_next)  # (p + 1 is the pair's: not handed out next)
            return port
    raise AssertionError("no two adjacent free ports")
