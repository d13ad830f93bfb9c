"""The simulator's accounting ledger: ended attempts per team, for ``policy.limits``.

The live store reads the same figures from ``usage_records`` (``store.limits``): GPU-seconds of
ended attempts inside a budget's window, each clipped to it, and for rolling windows the
``(end, GPU-seconds)`` pairs that date the renewal. Attempts are appended as they end (in
simulated-time order), one entry per budget they count against.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.limits import LedgerUse, Period, TeamLimits, month_start_s

__all__ = ["SimLedger"]

REFRESH_S = 60.0
"""The ledger's use of a window is computed again at most this often (simulated seconds): a
budget counts GPU-hours, a minute of lag in the ended part changes nothing measurable; the
running part is exact in every pass (``policy.limits.budget_statuses``)."""


@dataclass(slots=True)
class _Window:
    entries: deque[tuple[float, float, int]] = field(default_factory=deque)
    """(start_s, end_s, gpus) of ended attempts that count, in end order."""
    cached_at_s: float = -1.0
    cached: LedgerUse = field(default_factory=LedgerUse)


class SimLedger:
    """Ended attempts of the teams with budgets, kept per (team, budget key)."""

    def __init__(self, limits: Mapping[str, TeamLimits]) -> None:
        self.limits = {t: lim for t, lim in limits.items() if lim.class_budgets or lim.gpu_budgets}
        self._w: dict[tuple[str, str], _Window] = {}
        for t, lim in self.limits.items():
            for cb in lim.class_budgets:
                self._w[(t, cb.key)] = _Window()
            for gb in lim.gpu_budgets:
                self._w[(t, gb.key)] = _Window()

    def record(
        self,
        team_id: str,
        priority: PriorityClass,
        gpu_type: str,
        start_s: float,
        end_s: float,
        gpus: int,
    ) -> None:
        lim = self.limits.get(team_id)
        if lim is None or end_s <= start_s:
            return
        for cb in lim.class_budgets:
            if cb.priority is priority:
                self._w[(team_id, cb.key)].entries.append((start_s, end_s, gpus))
        for gb in lim.gpu_budgets:
            if gb.gpu_type is None or gb.gpu_type == gpu_type:
                self._w[(team_id, gb.key)].entries.append((start_s, end_s, gpus))

    def uses(self, now_s: float) -> dict[tuple[str, str], LedgerUse]:
        out: dict[tuple[str, str], LedgerUse] = {}
        for t, lim in self.limits.items():
            for cb in lim.class_budgets:
                out[(t, cb.key)] = self._use((t, cb.key), now_s - cb.window_s, now_s)
            for gb in lim.gpu_budgets:
                if gb.period is Period.MONTH:
                    ws = month_start_s(now_s)
                else:
                    assert gb.window_s is not None
                    ws = now_s - gb.window_s
                out[(t, gb.key)] = self._use((t, gb.key), ws, now_s)
        return out

    def _use(self, key: tuple[str, str], ws: float, now_s: float) -> LedgerUse:
        w = self._w[key]
        if w.cached_at_s >= 0 and now_s - w.cached_at_s < REFRESH_S:
            return w.cached
        entries = w.entries
        while entries and entries[0][1] <= ws:
            entries.popleft()
        releases = [(e, g * (e - max(s, ws))) for s, e, g in entries]
        w.cached = LedgerUse(sum(x for _, x in releases), releases)
        w.cached_at_s = now_s
        return w.cached
