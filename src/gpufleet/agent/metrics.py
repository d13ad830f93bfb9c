"""Node agent metrics for Prometheus, served by ``gpufleet agent --metrics-port PORT``.

One agent is one scrape target, so no metric carries a node label except ``gpufleet_agent_info``
(join on ``instance`` to name the node). Units: seconds, bytes, counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram

INFO = Gauge(
    "gpufleet_agent_info",
    "Always 1; labels name the node this agent serves and its agent epoch.",
    ["node_id", "agent_epoch"],
)
RUNNING = Gauge(
    "gpufleet_agent_running_attempts",
    "Attempts this agent holds (assigned, running or stopping), as of the last heartbeat.",
)
FREE_GPUS = Gauge("gpufleet_agent_free_gpus", "GPUs of this node not held by a live attempt.")
HEARTBEAT_RTT = Histogram(
    "gpufleet_agent_heartbeat_rtt_seconds",
    "Round-trip time of a Heartbeat call to the controller (answered calls only).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
HEARTBEAT_FAILURES = Counter(
    "gpufleet_agent_heartbeat_failures_total",
    "Heartbeats the controller did not answer.",
)
UPLOAD_BYTES = Counter(
    "gpufleet_agent_upload_bytes",
    "Bytes uploaded to the object store (live log mirrors, checkpoints, artifacts, "
    "manifests); rate() gives bytes per second.",
)
DISK_FREE = Gauge(
    "gpufleet_agent_disk_free_bytes",
    "Free space of the agent's state and scratch directories, bytes.",
    ["path"],
)


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
