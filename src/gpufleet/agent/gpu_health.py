"""GPU health from NVML, folded into the agent's node health (issue: bad nodes are not chosen).

A node whose GPU is lost, has uncorrectable ECC errors, is waiting for a reset to retire memory
pages, or raised a critical XID becomes UNHEALTHY at the controller (no new placements; ``why``
and ``gpufleet nodes`` name the reason) through the heartbeat's ``health`` string. Work already
running is not touched: an operator drains or fences the node.

Critical XIDs are every XID except the ones NVIDIA's Kubernetes device plugin also treats as
application errors (13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout):
those are caused by a job, not by the GPU.

NVML calls go through the ``pynvml`` module given to :class:`GpuHealth`, so the tests can give
a stand-in for the driver (this machine has no GPU: the one true external edge here).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from gpufleet.domain.types import GpuDevice

logger = logging.getLogger("gpufleet.agent")

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs caused by a job's own code; they do not make the node unhealthy."""
CHECK_EVERY_S = 10.0
"""NVML is asked at most this often; heartbeats in between reuse the last answer."""

_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0


class GpuHealth:
    """Checks the node's NVML GPUs.

    Args:
        gpus: the inventory's GPUs (from NVML: their ``uuid`` finds the device again).
        nvml: the ``pynvml`` module, initialised by this object; None disables the checks.
        clock: seconds, monotonic (a parameter for tests).

    :meth:`problem` never raises: an NVML failure is itself the problem it reports.
    """

    def __init__(
        self, gpus: Sequence[GpuDevice], nvml: Any | None, clock: Any = time.monotonic
    ) -> None:
        self.gpus = tuple(gpus)
        self.nvml = nvml
        self.clock = clock
        self._checked_at: float | None = None
        self._last: str | None = None
        self._xids: list[str] = []  # critical XIDs seen since start, sticky
        self._events: Any | None = None
        if nvml is None:
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError: the driver went away since the inventory
            logger.warning("GPU health checks off: NVML did not initialise (%s)", exc)
            self.nvml = None
            return
        with contextlib.suppress(Exception):  # XID events are not supported everywhere
            events = nvml.nvmlEventSetCreate()
            for g in self.gpus:
                handle = nvml.nvmlDeviceGetHandleByUUID(g.uuid)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            self._events = events

    @classmethod
    def for_inventory(cls, gpus: Sequence[GpuDevice], source: str) -> GpuHealth:
        """Checks on when the inventory came from NVML; off for declared GPUs."""
        if source != "nvml":
            return cls(gpus, None)
        try:
            import pynvml
        except ImportError:
            return cls(gpus, None)
        return cls(gpus, pynvml)

    def problem(self) -> str | None:
        """``GPU 3 (uuid): ...`` for the first failed check, or None when all pass."""
        if self.nvml is None:
            return None
        now = self.clock()
        if self._checked_at is not None and now - self._checked_at < CHECK_EVERY_S:
            return self._last
        self._checked_at = now
        self._poll_xids()
        self._last = self._xids[0] if self._xids else self._check_devices()
        if self._last:
            logger.warning("GPU health: %s", self._last)
        return self._last

    def _check_devices(self) -> str | None:
        nvml = self.nvml
        assert nvml is not None
        for g in self.gpus:
            where = f"GPU {g.index} ({g.uuid})"
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(g.uuid)
            except Exception as exc:
                return f"{where}: unavailable ({exc})"
            try:
                errors = nvml.nvmlDeviceGetTotalEccErrors(
                    handle, _NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _NVML_VOLATILE_ECC
                )
            except Exception:  # ECC not supported or not enabled on this board
                errors = 0
            if errors:
                return f"{where}: {errors} uncorrectable ECC error(s) since the last reset"
            with contextlib.suppress(Exception):
                if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                    return f"{where}: memory page retirement pending (needs a GPU reset)"
        return None

    def _poll_xids(self) -> None:
        if self._events is None:
            return
        nvml = self.nvml
        assert nvml is not None
        while True:
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: no more events
                return
            xid = int(getattr(event, "eventData", 0))
            if xid in APPLICATION_XIDS:
                continue
            index = next((g.index for g in self.gpus if _same_device(nvml, event, g)), "?")
            self._xids.append(f"GPU {index}: critical XID {xid} (see the driver's log)")


def _same_device(nvml: Any, event: Any, gpu: GpuDevice) -> bool:
    try:
        uuid = nvml.nvmlDeviceGetUUID(event.device)
    except Exception:
        return False
    return (uuid.decode() if isinstance(uuid, bytes) else uuid) == gpu.uuid
