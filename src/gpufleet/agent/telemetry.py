"""The agent's hooks into its Prometheus metrics (:mod:`gpufleet.agent.metrics`), no-ops
until :func:`enable` is called: ``prometheus_client`` (with its HTTP server and WSGI modules,
~3 MB of resident memory) is imported only by an agent that serves ``--metrics-port``, and an
agent that serves none does not count what nobody can read."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import ModuleType

_metrics: ModuleType | None = None


def enable() -> ModuleType:
    """Import :mod:`gpufleet.agent.metrics` and route the hooks below to it; returns it."""
    global _metrics
    from gpufleet.agent import metrics

    _metrics = metrics
    return metrics


def note_heartbeat(running: int, free_gpus: int, disk_free_mb: Mapping[str, int]) -> None:
    """See :func:`gpufleet.agent.metrics.note_heartbeat`."""
    if _metrics is not None:
        _metrics.note_heartbeat(running, free_gpus, disk_free_mb)


def heartbeat_timer() -> contextlib.AbstractContextManager[None]:
    """See :func:`gpufleet.agent.metrics.heartbeat_timer`."""
    if _metrics is not None:
        timer: contextlib.AbstractContextManager[None] = _metrics.heartbeat_timer()
        return timer
    return contextlib.nullcontext()


def count_upload(nbytes: int) -> None:
    """Bytes uploaded to the object store (``gpufleet_agent_upload_bytes``)."""
    if _metrics is not None:
        _metrics.UPLOAD_BYTES.inc(nbytes)


__all__ = ["count_upload", "enable", "heartbeat_timer", "note_heartbeat"]
