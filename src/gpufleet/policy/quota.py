"""Quotas: guarantees, borrowing and lending, tracked per team for one pass.

Per team and GPU type: a guarantee (GPUs the team gets back within a grace period whenever
it has work), a borrow limit (how many GPUs in total, over all types, it may run above its
guarantees on idle capacity) and a lending limit (the part of its unused guarantee that is
never lent). Allocation counts every attempt that holds GPUs, including stopping ones.

``TeamBook.admit`` is the single quota check of the pass; ``charge`` records a placement so
later checks in the same pass see it. Rules:

  * GPUs inside the team's guarantee are always admissible;
  * GPUs above it are *borrowed*: refused when borrowing is off (each team confined to its
    guarantee), when the team's borrow limit is reached, or when they would eat into other
    teams' unused guarantee that their lending limit protects.

A priority class does not change any of this: CRITICAL work of a team runs within its
guarantee plus what it may borrow, never on another team's guaranteed GPUs (seed DD4).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.snapshot import RunningJob, TeamState

TEAM_AT_GUARANTEE = "team_at_guarantee"
OVER_BORROW_LIMIT = "over_borrow_limit"
GUARANTEE_PROTECTED = "guarantee_protected"


class TeamBook:
    """Allocation of every team during one pass (starts from the running attempts)."""

    def __init__(
        self,
        teams: Mapping[str, TeamState],
        running: Iterable[RunningJob],
        capacity_gpus: Mapping[str, int],
        capacity_cpu: float,
        capacity_memory_mb: int,
        config: PolicyConfig,
    ) -> None:
        self._teams = teams
        self._cfg = config
        self.alloc: dict[str, dict[str, float]] = {}
        """Team -> GPU type -> GPUs held (a share counts its fraction: two 0.5-GPU jobs
        hold one GPU)."""
        self.cpu: dict[str, float] = {}
        self.mem: dict[str, int] = {}
        if teams and all(ts.allocated_gpus is not None for ts in teams.values()):
            running = ()
            for tid, ts in teams.items():
                self.alloc[tid] = dict(ts.allocated_gpus or {})
                self.cpu[tid] = ts.allocated_cpu
                self.mem[tid] = ts.allocated_memory_mb
        for r in running:
            a = self.alloc.setdefault(r.team_id, {})
            a[r.gpu_type] = a.get(r.gpu_type, 0) + r.gpus
            self.cpu[r.team_id] = self.cpu.get(r.team_id, 0.0) + r.cpu
            self.mem[r.team_id] = self.mem.get(r.team_id, 0) + r.memory_mb
        self._initial: dict[str, dict[str, float]] = {t: dict(a) for t, a in self.alloc.items()}
        self._cap_gpus = capacity_gpus
        self._cap_cpu = capacity_cpu
        self._cap_mem = capacity_memory_mb
        self._defaults: dict[str, TeamState] = {}
        self._largest_share: dict[str, float] = {}
        """Team id -> its largest share of any resource before the weight (the dominant
        share's numerator), computed on first use and raised by ``charge``: allocations
        only grow during a pass, so the largest share is the old one or a charged one."""
        # Unlent guarantee per type: sum over teams of min(unused guarantee, lending limit).
        self._protected: dict[str, float] = {}
        for tid, ts in teams.items():
            for gpu_type in ts.lending_limit_gpus:
                self._protected[gpu_type] = self._protected.get(gpu_type, 0) + self._keep(
                    tid, gpu_type
                )

    def team(self, team_id: str) -> TeamState:
        ts = self._teams.get(team_id)
        if ts is None:
            ts = self._defaults.setdefault(team_id, TeamState(team_id))
        return ts

    def guarantee(self, team_id: str, gpu_type: str) -> int:
        return self.team(team_id).guaranteed_gpus.get(gpu_type, 0)

    def allocated(self, team_id: str, gpu_type: str) -> float:
        return self.alloc.get(team_id, {}).get(gpu_type, 0)

    def initial_excess(self, team_id: str, gpu_type: str) -> float:
        """GPUs of ``gpu_type`` the team ran above its guarantee at the start of the pass."""
        return self._initial.get(team_id, {}).get(gpu_type, 0) - self.guarantee(team_id, gpu_type)

    def _keep(self, team_id: str, gpu_type: str) -> float:
        ts = self.team(team_id)
        keep = ts.lending_limit_gpus.get(gpu_type, 0)
        unused = max(0, ts.guaranteed_gpus.get(gpu_type, 0) - self.allocated(team_id, gpu_type))
        return min(unused, keep)

    def kept_back_by_others(self, team_id: str, gpu_type: str) -> list[tuple[str, float, int]]:
        """(team, GPUs of ``gpu_type`` it keeps back now, its guarantee) for every other team
        that keeps unused guarantee back from lending (Kueue: nominalQuota - lendingLimit),
        most first: what ``guarantee_protected`` waits on."""
        out = [
            (tid, self._keep(tid, gpu_type), self.guarantee(tid, gpu_type))
            for tid, ts in self._teams.items()
            if tid != team_id and gpu_type in ts.lending_limit_gpus
        ]
        return sorted((t for t in out if t[1] > 0), key=lambda t: (-t[1], t[0]))

    def capacity(self, gpu_type: str) -> int:
        """The fleet's GPUs of ``gpu_type`` in this pass's snapshot."""
        return int(self._cap_gpus.get(gpu_type, 0))

    def borrowed_total(self, team_id: str) -> float:
        return sum(
            max(0, n - self.guarantee(team_id, t)) for t, n in self.alloc.get(team_id, {}).items()
        )

    def under_guarantee(self, team_id: str, gpu_types: Iterable[str]) -> bool:
        """The team uses less than its guarantee on one of ``gpu_types``."""
        alloc = self.alloc.get(team_id, {})
        guaranteed = self.team(team_id).guaranteed_gpus
        # (asked on every team pop: the two dicts read once, a loop without a generator)
        for t in gpu_types:  # noqa: SIM110 - any() with a generator costs more per pop
            if alloc.get(t, 0) < guaranteed.get(t, 0):
                return True
        return False

    def fits_in_guarantee(self, team_id: str, gpu_type: str, gpus: float) -> bool:
        return self.allocated(team_id, gpu_type) + gpus <= self.guarantee(team_id, gpu_type)

    def admit(self, team_id: str, gpu_type: str, gpus: float, free_of_type: float) -> str | None:
        """None when ``gpus`` more GPUs of ``gpu_type`` are within the team's quota, else the
        refusal code (``team_at_guarantee``, ``over_borrow_limit``, ``guarantee_protected``)."""
        alloc = self.allocated(team_id, gpu_type)
        guar = self.guarantee(team_id, gpu_type)
        if alloc + gpus <= guar:  # (the usual answer: nothing borrowed, no more calls)
            return None
        new_borrow = max(0, alloc + gpus - guar) - max(0, alloc - guar)
        if new_borrow <= 0:
            return None
        if not self._cfg.borrowing:
            return TEAM_AT_GUARANTEE
        limit = self.team(team_id).borrow_limit_gpus
        if limit is not None and self.borrowed_total(team_id) + new_borrow > limit:
            return OVER_BORROW_LIMIT
        protected = self._protected.get(gpu_type, 0) - self._keep(team_id, gpu_type)
        if protected > 0 and free_of_type - gpus < protected:
            return GUARANTEE_PROTECTED
        return None

    def charge(self, team_id: str, gpu_type: str, gpus: float, cpu: float, memory_mb: int) -> None:
        protected = gpu_type in self._protected
        before = self._keep(team_id, gpu_type) if protected else 0
        a = self.alloc.setdefault(team_id, {})
        a[gpu_type] = a.get(gpu_type, 0) + gpus
        self.cpu[team_id] = self.cpu.get(team_id, 0.0) + cpu
        self.mem[team_id] = self.mem.get(team_id, 0) + memory_mb
        if protected:
            self._protected[gpu_type] += self._keep(team_id, gpu_type) - before
        share = self._largest_share.get(team_id)
        if gpus < 0 or cpu < 0 or memory_mb < 0:  # (never in a pass: computed again if so)
            self._largest_share.pop(team_id, None)
        elif share is not None:  # allocations only grew: the old largest or a charged share
            self._largest_share[team_id] = max(share, self._largest(team_id, (gpu_type,)))

    def dominant_share(self, team_id: str) -> float:
        """Weighted dominant share: the largest of the team's shares of each GPU type, of CPU
        and of memory, divided by its weight (DRF: Ghodsi et al., NSDI 2011)."""
        share = self._largest_share.get(team_id)
        if share is None:
            share = self._largest_share[team_id] = self._largest(team_id)
        return share / max(self.team(team_id).weight, 1e-9)

    def _largest(self, team_id: str, gpu_types: tuple[str, ...] | None = None) -> float:
        """The team's largest share of a GPU type (of ``gpu_types``, else of every type it
        holds), of CPU or of memory (0.0 if none)."""
        # (``if s > share`` is what ``max(share, s)`` does)
        share = 0.0
        cap_gpus = self._cap_gpus
        alloc = self.alloc.get(team_id, {})
        for t in alloc if gpu_types is None else gpu_types:
            cap = cap_gpus.get(t, 0)
            if cap:
                s = alloc.get(t, 0) / cap
                if s > share:
                    share = s
        if self._cap_cpu:
            s = self.cpu.get(team_id, 0.0) / self._cap_cpu
            if s > share:
                share = s
        if self._cap_mem:
            s = self.mem.get(team_id, 0) / self._cap_mem
            if s > share:
                share = s
        return share
