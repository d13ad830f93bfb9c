"""Node agent metrics for Prometheus, served by ``gpufleet agent --metrics-port PORT``.

One agent is one scrape target, so no metric carries a node label except ``gpufleet_agent_info``
(join on ``instance`` to name the node). Units: seconds, bytes, counts.

The metrics live in this module's own ``REGISTRY``, not prometheus_client's default one: the
API and controller processes import agent code (``processes``, the CLI) and would otherwise
export every ``gpufleet_agent_*`` series with dead zero values. Only the agent's metrics port
serves ``REGISTRY`` (with the agent process's own process/platform collectors).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

REGISTRY = CollectorRegistry(auto_describe=True)

INFO = Gauge(
    "gpufleet_agent_info",
    "Always 1; labels name the node this agent serves and its agent epoch.",
    ["node_id", "agent_epoch"],
    registry=REGISTRY,
)
RUNNING = Gauge(
    "gpufleet_agent_running_attempts",
    "Attempts this agent holds (assigned, running or stopping), as of the last heartbeat.",
    registry=REGISTRY,
)
FREE_GPUS = Gauge(
    "gpufleet_agent_free_gpus",
    "GPUs of this node not held by a live attempt.",
    registry=REGISTRY,
)
HEARTBEAT_RTT = Histogram(
    "gpufleet_agent_heartbeat_rtt_seconds",
    "Round-trip time of a Heartbeat call to the controller (answered calls only).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
HEARTBEAT_FAILURES = Counter(
    "gpufleet_agent_heartbeat_failures_total",
    "Heartbeats the controller did not answer.",
    registry=REGISTRY,
)
UPLOAD_BYTES = Counter(
    "gpufleet_agent_upload_bytes",
    "Bytes uploaded to the object store (live log mirrors, checkpoints, artifacts, "
    "manifests); rate() gives bytes per second.",
    registry=REGISTRY,
)
DISK_FREE = Gauge(
    "gpufleet_agent_disk_free_bytes",
    "Free space of the agent's state and scratch directories, bytes.",
    ["path"],
    registry=REGISTRY,
)


def serve(port: int, addr: str, auth: Any = None, cfg: Any = None) -> None:
    """Serve ``REGISTRY`` plus this process's process/platform/GC collectors on
    ``http://addr:port/metrics`` from a daemon thread; ``auth``: a
    :class:`gpufleet.metrics_http.BasicAuth` (None: no auth); ``cfg``: an ``AgentConfig``
    whose ``metrics_tls_cert``/``metrics_tls_key`` (if set) make it HTTPS.

    Raises:
        OSError: the port cannot be bound.
    """
    from gpufleet import metrics_http

    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        with suppress(ValueError):  # already registered by an earlier serve() in this process
            REGISTRY.register(collector)
    cert = getattr(cfg, "metrics_tls_cert", "") or None
    key = getattr(cfg, "metrics_tls_key", "") or None
    metrics_http.serve(port, addr, REGISTRY, auth=auth, certfile=cert, keyfile=key)


@contextmanager
def heartbeat_timer() -> Iterator[None]:
    """Time one Heartbeat call: observed when it returns, counted as a failure if it raises."""
    t0 = time.perf_counter()
    try:
        yield
    except Exception:
        HEARTBEAT_FAILURES.inc()
        raise
    HEARTBEAT_RTT.observe(time.perf_counter() - t0)


def note_heartbeat(running: int, free_gpus: int, disk_free_mb: Mapping[str, int]) -> None:
    """The node's state as sent in a heartbeat."""
    RUNNING.set(running)
    FREE_GPUS.set(free_gpus)
    for path, mb in disk_free_mb.items():
        DISK_FREE.labels(path).set(mb * 1024 * 1024)
