"""The preemption waste cap: a bound on the work preemption may destroy (pure; shared with
the simulator).

A preemption costs its victims the work done since their last checkpoint (or since their
start, when they never checkpointed): GPUs x that time, in GPU-hours, the same measure as
the victim cost of ``policy.preemption``. Per rolling window the sum of that loss is
bounded

* per team, as victims (``TeamLimits.preemption_waste``, from ``teams.limits``:
  ``{"preemption_waste": {"gpu_hours": 20, "window_s": 86400}}``), and
* fleet-wide (``PolicyConfig.preemption_waste_gpu_h`` per ``preemption_waste_window_s``).

Both default to unlimited. A victim set (every member of a victim gang) whose loss would take
a team or the fleet past its cap is not preempted: the search's choice is undone and the job
waits for GPUs to free up (or for its backfill reservation), and its ``why`` says the cap held
it (code ``preemption_waste_cap``). What was lost is what the driver gives as
:class:`WasteState.recent` (the live store: ``job_runs`` stopped for a preemption, with their
checkpoint age; the simulator: its own displacements) plus the preemptions of this pass.

Hooked in once: :func:`victim_search` builds the pass's victim search (a
:class:`CappedVictimSearch` when any cap is set, the plain ``VictimSearch`` otherwise), and
:func:`with_waste_reasons` adds the cap's reason to the pass's waiting reasons.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.decisions import Preempt, WaitReason
from gpufleet.policy.figures import gpu_h
from gpufleet.policy.placement import FreeIndex
from gpufleet.policy.preemption import SetCost, VictimSearch
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import PendingJob, RunningJob

if TYPE_CHECKING:
    from gpufleet.policy.config import PolicyConfig

__all__ = [
    "DEFAULT_WINDOW_S",
    "WASTE_CAP",
    "CappedVictimSearch",
    "Refusal",
    "Waste",
    "WasteBook",
    "WasteLimit",
    "WasteState",
    "lost_gpu_h",
    "victim_search",
    "waste_by_team",
    "with_waste_reasons",
]

DEFAULT_WINDOW_S = 24 * 3600.0
"""The rolling window of a cap that names none, seconds (one day)."""
WASTE_CAP = "preemption_waste_cap"
"""The ``WaitReason.code`` of a job whose preemption the cap refused."""
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class WasteLimit:
    """A cap: at most ``gpu_hours`` of work lost to preemption per rolling ``window_s``."""

    gpu_hours: float
    window_s: float = DEFAULT_WINDOW_S


@dataclass(frozen=True, slots=True)
class Waste:
    """Work one preempted attempt lost: its team (the victim's), when it was told to stop
    (snapshot clock, seconds) and GPUs x time since its last checkpoint, GPU-hours."""

    team_id: str
    at_s: float
    gpu_hours: float


@dataclass(frozen=True, slots=True)
class WasteState:
    """What the pass needs to keep the caps (``ClusterSnapshot.preemption_waste``).

    Attributes:
        recent: the losses of the longest window in force (older entries are ignored).
        team_caps: per victim team, its cap (a team not listed has none).
    """

    recent: tuple[Waste, ...] = ()
    team_caps: Mapping[str, WasteLimit] = field(default_factory=dict)


def lost_gpu_h(r: RunningJob, now_s: float) -> float:
    """GPU-hours ``r`` would lose if stopped at ``now_s``: its GPUs x the time since the later
    of its start and its last checkpoint (never negative)."""
    since = (
        r.started_at_s if r.last_checkpoint_s is None else max(r.started_at_s, r.last_checkpoint_s)
    )
    return r.gpu_count * max(0.0, now_s - since) / 3600.0


def waste_by_team(recent: Sequence[Waste], now_s: float, window_s: float) -> dict[str, float]:
    """GPU-hours lost per victim team over ``(now_s - window_s, now_s]``."""
    out: dict[str, float] = {}
    start = now_s - window_s
    for w in recent:
        if w.at_s > start:
            out[w.team_id] = out.get(w.team_id, 0.0) + w.gpu_hours
    return out


class WasteBook:
    """The caps and what was lost, for one pass: :meth:`refusal` of a victim set, then
    :meth:`charge` of the one made (so a pass's later preemptions see its earlier ones)."""

    def __init__(self, state: WasteState, fleet: WasteLimit | None, now_s: float) -> None:
        self.now_s = now_s
        self.fleet = fleet
        self.team_caps = dict(state.team_caps)
        self.fleet_used = 0.0
        if fleet is not None:
            self.fleet_used = sum(waste_by_team(state.recent, now_s, fleet.window_s).values())
        self.team_used: dict[str, float] = {}
        for team_id, cap in self.team_caps.items():
            self.team_used[team_id] = waste_by_team(state.recent, now_s, cap.window_s).get(
                team_id, 0.0
            )

    def loss(self, victims: Sequence[RunningJob]) -> dict[str, float]:
        """GPU-hours the victims (every member listed once) would lose, per victim team."""
        out: dict[str, float] = {}
        for r in victims:
            out[r.team_id] = out.get(r.team_id, 0.0) + lost_gpu_h(r, self.now_s)
        return out

    def refusal(self, victims: Sequence[RunningJob]) -> Refusal | None:
        """None when stopping ``victims`` keeps every cap; else the first cap it would break
        (a team's before the fleet's, teams by id)."""
        loss = self.loss(victims)
        for team_id in sorted(loss):
            cap = self.team_caps.get(team_id)
            if cap is None:
                continue
            used = self.team_used.get(team_id, 0.0)
            if used + loss[team_id] > cap.gpu_hours + _EPS:
                return Refusal(team_id, cap, used, loss[team_id])
        if self.fleet is not None:
            total = sum(loss.values())
            if self.fleet_used + total > self.fleet.gpu_hours + _EPS:
                return Refusal(None, self.fleet, self.fleet_used, total)
        return None

    def charge(self, victims: Sequence[RunningJob]) -> None:
        """Count a preemption this pass made."""
        for team_id, lost in self.loss(victims).items():
            self.fleet_used += lost
            if team_id in self.team_used:
                self.team_used[team_id] += lost


@dataclass(frozen=True, slots=True)
class Refusal:
    """A cap a victim set would break: the team's (``team_id``) or the fleet's (None), the
    GPU-hours already lost in its window (``used_gpu_h``) and the set's loss (``loss_gpu_h``)."""

    team_id: str | None
    cap: WasteLimit
    used_gpu_h: float
    loss_gpu_h: float

    def details(self) -> dict[str, object]:
        """For ``WaitReason.details["waste_cap"]``."""
        return {
            "scope": "fleet" if self.team_id is None else "team",
            "team_id": self.team_id,
            "cap_gpu_h": self.cap.gpu_hours,
            "window_s": self.cap.window_s,
            "used_gpu_h": round(self.used_gpu_h, 6),
            "loss_gpu_h": round(self.loss_gpu_h, 6),
        }

    def note(self) -> str:
        """One sentence: which cap refused the preemption, and by how much."""
        whose = "the fleet's" if self.team_id is None else f"team {self.team_id}'s"
        return (
            f"a preemption for it would lose {gpu_h(self.loss_gpu_h)} GPU-h of work, over"
            f" {whose} preemption waste cap ({gpu_h(self.cap.gpu_hours)} GPU-h per"
            f" {_hours(self.cap.window_s)}, {gpu_h(self.used_gpu_h)} used): it waits for GPUs"
            " to free up instead"
        )


class CappedVictimSearch(VictimSearch):
    """``VictimSearch`` whose every found set is checked against the caps (:class:`WasteBook`):
    a set that would break one is given back (its victims not taken) and the job is noted in
    ``refused`` with the cap's facts."""

    def __init__(
        self,
        running: RunningIndex,
        book: TeamBook,
        now_s: float,
        head_start_s: Mapping[PriorityClass, float] | None,
        waste: WasteBook,
    ) -> None:
        super().__init__(running, book, now_s, head_start_s)
        self.waste = waste
        self.refused: dict[str, Refusal] = {}
        self._by_run: dict[str, RunningJob] | None = None

    def _capped(self, job: PendingJob, run_ids: Sequence[str], before: set[str]) -> bool:
        """True (and the set given back) when the victims ``run_ids`` break a cap."""
        if self._by_run is None:
            self._by_run = {
                r.run_id: r for runs in self._running.by_node.values() for _, r in runs
            }
        victims = [self._by_run[v] for v in run_ids if v in self._by_run]
        why = self.waste.refusal(victims)
        if why is None:
            self.waste.charge(victims)
            self.refused.pop(job.job_id, None)
            return False
        self.taken = before
        self.refused[job.job_id] = why
        return True

    def find(
        self, job: PendingJob, index: FreeIndex, gpu_type: str, reason: str
    ) -> tuple[Preempt, SetCost] | None:
        before = set(self.taken)
        found = super().find(job, index, gpu_type, reason)
        if found is not None and self._capped(job, found[0].victim_run_ids, before):
            return None
        return found

    def find_gang(
        self,
        job: PendingJob,
        index: FreeIndex,
        gpu_type: str,
        reason: str,
        members: tuple[int, ...],
        free_nodes: Sequence[tuple[int, str]],
    ) -> list[Preempt] | None:
        before = set(self.taken)
        found = super().find_gang(job, index, gpu_type, reason, members, free_nodes)
        if found:
            ids = sorted({v for p in found for v in p.victim_run_ids})
            if self._capped(job, ids, before):
                return None
        return found


def victim_search(
    running: RunningIndex,
    book: TeamBook,
    now_s: float,
    head_start_s: Mapping[PriorityClass, float] | None,
    state: WasteState | None,
    config: PolicyConfig,
) -> VictimSearch:
    """The pass's victim search: capped when the fleet or any team has a cap."""
    fleet = (
        WasteLimit(config.preemption_waste_gpu_h, config.preemption_waste_window_s)
        if config.preemption_waste_gpu_h is not None
        else None
    )
    if fleet is None and (state is None or not state.team_caps):
        return VictimSearch(running, book, now_s, head_start_s)
    book_w = WasteBook(state or WasteState(), fleet, now_s)
    return CappedVictimSearch(running, book, now_s, head_start_s, book_w)


def _hours(window_s: float) -> str:
    h = window_s / 3600.0
    return f"{h / 24:g} d" if h >= 24 and h % 24 == 0 else f"{h:g} h"


class _WithWaste(Mapping[str, WaitReason]):
    """The pass's waiting reasons, those of the jobs the cap refused rewritten lazily."""

    def __init__(self, base: Mapping[str, WaitReason], refused: Mapping[str, Refusal]) -> None:
        self._base = base
        self._refused = refused

    def __getitem__(self, job_id: str) -> WaitReason:
        reason = self._base[job_id]
        why = self._refused.get(job_id)
        if why is None or reason.code in ("waiting_for_preemption", "gang_preemption"):
            return reason
        if reason.code == "waiting_with_reservation":
            # the reservation's start is when the work there ends by itself, which the cap
            # does not promise (the victims may run on for long): no start is said
            where = reason.details.get("node") or ", ".join(reason.details.get("nodes", ()))
            otherwise = f"GPUs on {where} are held for it until the work running there ends"
            return replace(
                reason,
                code=WASTE_CAP,
                message=f"{why.note()}; {otherwise}",
                details={**reason.details, "waste_cap": why.details(), "otherwise": reason.code},
                estimated_start_s=None,
            )
        return replace(
            reason,
            code=WASTE_CAP,
            message=f"{why.note()}; otherwise: {reason.message}",
            details={**reason.details, "waste_cap": why.details(), "otherwise": reason.code},
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._base


def with_waste_reasons(
    waiting: Mapping[str, WaitReason], victims: VictimSearch | None
) -> Mapping[str, WaitReason]:
    """``waiting`` with the reason of every job the cap refused (``preemption_waste_cap``;
    the reason it would otherwise have is in ``details.otherwise``)."""
    if not isinstance(victims, CappedVictimSearch) or not victims.refused:
        return waiting
    return _WithWaste(waiting, victims.refused)
