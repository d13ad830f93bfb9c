"""GPU utilization and memory of each attempt, sampled from NVML (``nvidia-ml-py``'s
``pynvml``) by the agent while the attempt runs, reported with its completion.

An attempt's figures: the mean of the samples' utilization (percent, averaged over its
GPUs) and the highest sum of its GPUs' used memory (bytes). A node without NVML (declared
GPUs, no driver, the module not installed) samples nothing and the figures are absent; an
NVML error on one call skips that sample. The whole node's GPU is measured, so a figure is
the attempt's own only because a reservation holds its GPUs exclusively.

NVML calls go through the ``pynvml`` module given to :class:`GpuSampler` (the tests give a
stand-in: this machine has no GPU, the one true external edge).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("gpufleet.agent")

SAMPLE_EVERY_S = 5.0
"""NVML is sampled at most this often (a sample costs two calls per GPU)."""


@dataclass(slots=True)
class _Acc:
    util_sum: float = 0.0
    samples: int = 0
    mem_peak: int = 0


class GpuSampler:
    """Per-attempt NVML samples.

    Args:
        nvml: the ``pynvml`` module, already initialised (``nvmlInit``) or initialised here;
            None disables sampling.
        every_s: the least time between two samples, seconds.
        clock: seconds, monotonic (a parameter for tests).
    """

    def __init__(
        self, nvml: Any | None, *, every_s: float = SAMPLE_EVERY_S, clock: Any = time.monotonic
    ) -> None:
        self.nvml = nvml
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, _Acc] = {}
        self._at: float | None = None
        if nvml is not None:
            try:
                nvml.nvmlInit()
            except Exception as exc:  # NVMLError: no driver
                logger.info("GPU usage sampling off: NVML did not initialise (%s)", exc)
                self.nvml = None

    @classmethod
    def for_inventory(cls, source: str) -> GpuSampler:
        """Sampling on when the inventory came from NVML and ``pynvml`` imports; else off."""
        if source != "nvml":
            return cls(None)
        try:
            import pynvml
        except ImportError:
            return cls(None)
        return cls(pynvml)

    @property
    def enabled(self) -> bool:
        return self.nvml is not None

    def sample(self, runs: Iterable[tuple[str, Sequence[int]]], *, force: bool = False) -> None:
        """One sample of each ``(run_id, gpu_indexes)``, unless the last was less than
        ``every_s`` ago (``force``: sample anyway). Never raises."""
        if self.nvml is None:
            return
        now = self.clock()
        if not force and self._at is not None and now - self._at < self.every_s:
            return
        self._at = now
        for run_id, gpus in runs:
            if not gpus:
                continue
            try:
                util, mem = 0.0, 0
                for index in gpus:
                    handle = self.nvml.nvmlDeviceGetHandleByIndex(int(index))
                    util += float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                    mem += int(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception as exc:  # a GPU gone, a driver hiccup: this sample skipped
                logger.debug("run %s: NVML sample failed: %s", run_id, exc)
                continue
            with self._lock:
                acc = self._runs.setdefault(run_id, _Acc())
                acc.util_sum += util / len(gpus)
                acc.samples += 1
                acc.mem_peak = max(acc.mem_peak, mem)

    def take(self, run_id: str) -> dict[str, int | float]:
        """The attempt's figures (``gpu_util_pct``, ``gpu_mem_peak_bytes``), forgotten here;
        empty when it was never sampled."""
        with self._lock:
            acc = self._runs.pop(run_id, None)
        if acc is None or acc.samples == 0:
            return {}
        return {
            "gpu_util_pct": round(acc.util_sum / acc.samples, 2),
            "gpu_mem_peak_bytes": acc.mem_peak,
        }
