"""Charged usage: GPU-seconds with exponential decay, attempt by attempt.

Usage is charged per attempt (JobRun) for the GPU-time it really held: ``gpu_count x
(released_at - reserved_at)``. A failed, retried or preempted job is charged once per attempt
for what that attempt held and nothing else, so retries and preemptions make a team neither
poorer nor richer than the GPU-time it consumed. Decay (half-life ``usage_half_life_s``) lets
old usage fade, so a team that burst last month is not punished today.

Pure functions on floats; the live controller keeps ``(value, as_of_s)`` per team in the
database and the simulator keeps it in memory. The two agree because both call these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def decay_factor(elapsed_s: float, half_life_s: float) -> float:
    """``2 ** (-elapsed/half_life)``; 1.0 when decay is off (half_life <= 0 or inf)."""
    if half_life_s <= 0 or math.isinf(half_life_s) or elapsed_s <= 0:
        return 1.0
    return math.exp(-math.log(2.0) * elapsed_s / half_life_s)


def interval_gpu_s(
    gpu_count: float, start_s: float, end_s: float, as_of_s: float, half_life_s: float
) -> float:
    """GPU-seconds of ``gpu_count`` GPUs held over ``[start_s, end_s]``, decayed to ``as_of_s``.

    Exact integral of ``g * 2**(-(as_of - t)/H)`` over the interval, so charging one long
    interval or many short pieces of it gives the same total.
    """
    if end_s <= start_s or gpu_count <= 0:
        return 0.0
    if half_life_s <= 0 or math.isinf(half_life_s):
        return gpu_count * (end_s - start_s)
    lam = math.log(2.0) / half_life_s
    late = math.exp(-lam * (as_of_s - end_s))
    early = math.exp(-lam * (as_of_s - start_s))
    return gpu_count * (late - early) / lam


@dataclass(slots=True)
class UsageLedger:
    """Decayed usage of one team: ``value`` GPU-seconds as of ``as_of_s``."""

    value: float = 0.0
    as_of_s: float = 0.0
    half_life_s: float = 7 * 24 * 3600.0

    def at(self, now_s: float) -> float:
        """The decayed value at ``now_s`` (>= ``as_of_s``)."""
        return self.value * decay_factor(now_s - self.as_of_s, self.half_life_s)

    def advance(self, now_s: float) -> None:
        if now_s > self.as_of_s:
            self.value = self.at(now_s)
            self.as_of_s = now_s

    def charge_attempt(self, gpu_count: float, start_s: float, end_s: float) -> None:
        """Charge one finished attempt that held ``gpu_count`` GPUs over ``[start_s, end_s]``."""
        self.advance(end_s)
        self.value += interval_gpu_s(gpu_count, start_s, end_s, self.as_of_s, self.half_life_s)

    def with_running(self, now_s: float, running: list[tuple[float, float]]) -> float:
        """Usage at ``now_s`` including the elapsed part of running attempts
        ``[(gpu_count, started_at_s), ...]`` (what ``TeamState.usage_gpu_s`` should hold)."""
        extra = sum(interval_gpu_s(g, s, now_s, now_s, self.half_life_s) for g, s in running)
        return self.at(now_s) + extra
