"""Clocks. Policy code never reads a clock: it gets ``now_s`` in its snapshot."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_s(self) -> float:
        """Seconds since the epoch, float."""
        ...


class SystemClock:
    def now_s(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (tests, the simulator)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now_s(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
