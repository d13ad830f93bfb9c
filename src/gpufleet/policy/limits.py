"""Team limits: priority-abuse limits and GPU-hour budgets (pure; shared with the simulator).

Priority classes order work *inside* a team's share, so on their own they cannot take GPUs
from other teams; they still buy a team's jobs a head start in its own queue, preemption of
its own lower work, and, under the strict-priority and FIFO baselines, the front of the fleet's
queue. A team that marks everything CRITICAL defeats the point of the classes, so an admin may
give each team:

* **allowed classes** (``TeamLimits.allowed_classes``): a submit of another class is refused
  (422 naming ``priority``) or demoted to the highest allowed class at or below NORMAL, as the
  admin chooses (``disallowed``); that part is decided at submit (``services.job_submit``) and
  again here for jobs submitted before the rule changed (they are demoted, never refused);
* **class budgets** (``ClassBudget``): GPU-hours per rolling window for a class above NORMAL
  (``CRITICAL 50 GPU-h / 7 d``). Over budget, the class's pending jobs are demoted to NORMAL
  for the pass (``over="demote"``) or held (``"hold"``) until the window has moved on far
  enough;
* **GPU-hour budgets** (``GpuBudget``): per calendar month (UTC) or rolling window, per GPU
  type or in total; ``hard`` ones hold the team's new jobs PENDING (code ``budget_exhausted``,
  with the renewal time) once used up, soft ones only warn (80% and 100%). Running work is
  never stopped for a budget.

**Pass time, not submit time.** A class budget is checked when a job is offered to a pass,
not when it is submitted: with a rolling window a job submitted under budget may start over
it (and one submitted over it may start after the window moved), so only the pass sees the
use that matters. The demotion is not written to the job: its requested class comes back as
soon as the budget allows; its attempt is charged to the class it was *placed* at
(``job_runs.priority``, read back as ``RunningJob.priority`` and ``usage_records.priority``).

**Use** is the accounting ledger (``usage_records``: ended attempts, clipped to the window)
given by the driver as :class:`LedgerUse`, plus the elapsed part of the attempts running now
(``ClusterSnapshot.running``), added here. Retries and requeues never reset it: every
attempt's GPU-time is in the ledger once it ends.

:func:`apply_limits` returns the snapshot the pass should see (demoted jobs with their
effective class, queues re-sorted only for the teams that changed, held jobs removed) and,
per job, what was done and why. Cost: one walk of the running attempts of the teams with a
budget, and of the pending jobs of teams over a budget (or with a class rule); none at all for
teams without limits.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.decisions import WaitReason
from gpufleet.policy.figures import gpu_h
from gpufleet.policy.priority import queue_key
from gpufleet.policy.snapshot import ClusterSnapshot, PendingJob, RunningJob
from gpufleet.policy.waste import WasteLimit

__all__ = [
    "WARN_FRACTIONS",
    "BudgetStatus",
    "ClassBudget",
    "Demotion",
    "Disallowed",
    "GpuBudget",
    "LedgerUse",
    "LimitsResult",
    "OverBudget",
    "Period",
    "TeamLimits",
    "any_soft_warning",
    "apply_limits",
    "budget_label",
    "budget_statuses",
    "demotion_note",
    "demotion_target",
    "month_start_s",
    "next_month_s",
    "soft_warning",
    "soft_warnings",
    "statuses_at",
    "submit_warnings",
    "with_demotion",
]

WARN_FRACTIONS: tuple[float, ...] = (0.8, 1.0)
"""A soft budget warns at these fractions of its GPU-hours (80% and 100%)."""


class Disallowed(enum.StrEnum):
    """What a submit of a class the team may not use gets."""

    REFUSE = "refuse"
    DEMOTE = "demote"


class OverBudget(enum.StrEnum):
    """What a job of a class over its budget gets."""

    DEMOTE = "demote"
    HOLD = "hold"


class Period(enum.StrEnum):
    """A GPU-hour budget's period: the UTC calendar month, or a rolling window."""

    MONTH = "month"
    ROLLING = "rolling"


@dataclass(frozen=True, slots=True)
class ClassBudget:
    """GPU-hours a team may run at ``priority`` (above NORMAL) per rolling ``window_s``."""

    priority: PriorityClass
    gpu_hours: float
    window_s: float
    over: OverBudget = OverBudget.DEMOTE

    @property
    def key(self) -> str:
        return f"class:{self.priority.value}"


@dataclass(frozen=True, slots=True)
class GpuBudget:
    """GPU-hours a team may use per period, on one GPU type (``gpu_type``) or in total (None).

    ``window_s`` is the rolling window's length (``Period.ROLLING`` only). ``hard``: used up,
    the team's new jobs wait (``budget_exhausted``); else it only warns."""

    gpu_hours: float
    period: Period = Period.MONTH
    window_s: float | None = None
    gpu_type: str | None = None
    hard: bool = False

    @property
    def key(self) -> str:
        """``gpu:H100:month``, ``gpu:*:rolling:30d``: a team's GPU budgets are keyed by GPU
        type and window (two rolling windows of one type are two budgets)."""
        base = f"gpu:{self.gpu_type or '*'}:{self.period.value}"
        if self.period is Period.ROLLING and self.window_s is not None:
            return f"{base}:{span(self.window_s)}"
        return base


def span(seconds: float) -> str:
    """A window as budget keys name it: ``30d``, ``2h``, ``90m``, ``45s``."""
    for unit, n in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:g}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True, slots=True)
class TeamLimits:
    """One team's limits (all optional: the default limits nothing)."""

    allowed_classes: frozenset[PriorityClass] | None = None
    disallowed: Disallowed = Disallowed.REFUSE
    class_budgets: tuple[ClassBudget, ...] = ()
    gpu_budgets: tuple[GpuBudget, ...] = ()
    preemption_waste: WasteLimit | None = None
    """The work preemption may destroy of this team's attempts per window (``policy.waste``;
    not applied here: the pass's victim search keeps it)."""

    @property
    def empty(self) -> bool:
        return (
            self.allowed_classes is None
            and not self.class_budgets
            and not self.gpu_budgets
            and self.preemption_waste is None
        )

    def window(self, key: str, now_s: float) -> tuple[float, float | None]:
        """``(start_s, length_s)`` of the budget ``key``'s window at ``now_s`` (length None:
        a calendar month)."""
        for cb in self.class_budgets:
            if cb.key == key:
                return now_s - cb.window_s, cb.window_s
        for gb in self.gpu_budgets:
            if gb.key == key:
                if gb.period is Period.MONTH:
                    return month_start_s(now_s), None
                assert gb.window_s is not None
                return now_s - gb.window_s, gb.window_s
        raise KeyError(key)


@dataclass(frozen=True, slots=True)
class LedgerUse:
    """What the ledger says of one (team, budget) window.

    Attributes:
        used_gpu_s: GPU-seconds of ended attempts inside the window (each clipped to it).
        releases: for a rolling window, ``(end_s, gpu_s)`` of those attempts (ordered by
            ``end_s``; ``gpu_s`` their part inside the window): an attempt leaves the window
            at the latest ``window_s`` after its end, which dates the renewal. The driver may
            leave it empty when the budget is far from used (the renewal is then said to be
            at most a window away).
    """

    used_gpu_s: float = 0.0
    releases: Sequence[tuple[float, float]] = ()


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    """One budget of one team at ``now_s``.

    Attributes:
        key: ``class:CRITICAL``, ``gpu:H100:month``, ``gpu:*:rolling``, ...
        limit_gpu_h / used_gpu_h: the budget and the use (ended + running), GPU-hours.
        window_start_s: the window's start (the month's first second, or now - window).
        renews_at_s: when the use is back under the budget if nothing more runs (a
            month's end; for a rolling window the time the ledger's attempts leave it, at
            the latest one window from now); None while under budget.
        hard: a hard GPU-hour budget (holds jobs); class budgets: ``over`` is ``hold``.
    """

    team_id: str
    key: str
    limit_gpu_h: float
    used_gpu_h: float
    window_start_s: float
    renews_at_s: float | None
    hard: bool
    priority: PriorityClass | None = None
    gpu_type: str | None = None

    @property
    def fraction(self) -> float:
        return self.used_gpu_h / self.limit_gpu_h if self.limit_gpu_h > 0 else float("inf")

    @property
    def exhausted(self) -> bool:
        return self.used_gpu_h >= self.limit_gpu_h

    @property
    def remaining_gpu_h(self) -> float:
        return max(0.0, self.limit_gpu_h - self.used_gpu_h)

    @property
    def warning(self) -> float | None:
        """The highest of :data:`WARN_FRACTIONS` reached, or None."""
        hit = [f for f in WARN_FRACTIONS if self.limit_gpu_h <= 0 or self.fraction >= f]
        return max(hit) if hit else None


@dataclass(frozen=True, slots=True)
class Demotion:
    """A job offered to the pass at a lower class than it asked for."""

    job_id: str
    requested: PriorityClass
    effective: PriorityClass
    ground: str
    """``class_budget`` (its class is over budget) or ``class_not_allowed``."""
    until_s: float | None = None
    """When its class's budget renews (None: until an admin allows the class)."""


@dataclass(frozen=True, slots=True)
class LimitsResult:
    snapshot: ClusterSnapshot
    demoted: Mapping[str, Demotion] = field(default_factory=dict)
    held: Mapping[str, WaitReason] = field(default_factory=dict)
    statuses: Mapping[tuple[str, str], BudgetStatus] = field(default_factory=dict)


def month_start_s(now_s: float) -> float:
    """The first second of ``now_s``'s UTC calendar month (epoch seconds)."""
    d = datetime.fromtimestamp(now_s, UTC)
    return datetime(d.year, d.month, 1, tzinfo=UTC).timestamp()


def next_month_s(now_s: float) -> float:
    """The first second of the UTC calendar month after ``now_s``'s."""
    d = datetime.fromtimestamp(now_s, UTC)
    y, m = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
    return datetime(y, m, 1, tzinfo=UTC).timestamp()


def demotion_target(allowed: frozenset[PriorityClass] | None) -> PriorityClass:
    """The class a disallowed job runs at: the highest allowed class at or below NORMAL,
    else the lowest allowed one (NORMAL when every class is allowed)."""
    if not allowed:
        return PriorityClass.NORMAL
    low = [p for p in allowed if p.rank <= PriorityClass.NORMAL.rank]
    if low:
        return max(low, key=lambda p: p.rank)
    return min(allowed, key=lambda p: p.rank)


def _running_gpu_s(r: RunningJob, start_s: float, now_s: float) -> float:
    return r.gpus * max(0.0, now_s - max(r.started_at_s, start_s))  # a share: its fraction


def _renewal(
    use: LedgerUse, running_gpu_s: float, limit_gpu_s: float, window_s: float, now_s: float
) -> float:
    """When the use of a rolling window falls under ``limit_gpu_s`` if nothing more runs: the
    ledger's attempts leave ``window_s`` after their end (a bound: they leave gradually from
    their start on), the running ones' part a window from now."""
    total = use.used_gpu_s + running_gpu_s
    for end_s, gpu_s in use.releases:
        total -= gpu_s
        if total < limit_gpu_s:
            return max(now_s, end_s + window_s)
    return now_s + window_s


def budget_statuses(
    snapshot: ClusterSnapshot,
    limits: Mapping[str, TeamLimits],
    ledger: Mapping[tuple[str, str], LedgerUse],
) -> dict[tuple[str, str], BudgetStatus]:
    """Every budget of every team in ``limits`` at ``snapshot.now_s``: the ledger's use plus
    the elapsed part of the team's running attempts inside the window (a class budget counts
    attempts placed at its class, a typed budget attempts on its GPU type)."""
    return statuses_at(snapshot.now_s, snapshot.running, limits, ledger)


def statuses_at(
    now_s: float,
    running_attempts: Iterable[RunningJob],
    limits: Mapping[str, TeamLimits],
    ledger: Mapping[tuple[str, str], LedgerUse],
) -> dict[tuple[str, str], BudgetStatus]:
    """:func:`budget_statuses` from its parts: ``running_attempts`` are the attempts holding
    GPUs now (only ``team_id``, ``priority``, ``gpu_count``, ``gpu_type`` and
    ``started_at_s`` are read), ``now_s`` epoch seconds. What the API answers (``usage``,
    ``submit``'s warnings) without a scheduling snapshot."""
    now = now_s
    running: dict[str, list[RunningJob]] = {}
    budgeted = {t for t, lim in limits.items() if lim.class_budgets or lim.gpu_budgets}
    if budgeted:
        for r in running_attempts:
            if r.team_id in budgeted:
                running.setdefault(r.team_id, []).append(r)
    out: dict[tuple[str, str], BudgetStatus] = {}
    for team_id in sorted(budgeted):
        lim = limits[team_id]
        mine = running.get(team_id, ())
        for cb in lim.class_budgets:
            start = now - cb.window_s
            run_s = sum(_running_gpu_s(r, start, now) for r in mine if r.priority is cb.priority)
            use = ledger.get((team_id, cb.key), LedgerUse())
            used = use.used_gpu_s + run_s
            limit_s = cb.gpu_hours * 3600.0
            renews: float | None = None
            if used >= limit_s:
                renews = _renewal(use, run_s, limit_s, cb.window_s, now)
            out[(team_id, cb.key)] = BudgetStatus(
                team_id,
                cb.key,
                cb.gpu_hours,
                used / 3600.0,
                start,
                renews,
                cb.over is OverBudget.HOLD,
                priority=cb.priority,
            )
        for gb in lim.gpu_budgets:
            if gb.period is Period.MONTH:
                start, window = month_start_s(now), None
            else:
                assert gb.window_s is not None
                start, window = now - gb.window_s, gb.window_s
            run_s = sum(
                _running_gpu_s(r, start, now)
                for r in mine
                if gb.gpu_type is None or r.gpu_type == gb.gpu_type
            )
            use = ledger.get((team_id, gb.key), LedgerUse())
            used = use.used_gpu_s + run_s
            limit_s = gb.gpu_hours * 3600.0
            renews = None
            if used >= limit_s:
                renews = (
                    next_month_s(now)
                    if window is None
                    else _renewal(use, run_s, limit_s, window, now)
                )
            out[(team_id, gb.key)] = BudgetStatus(
                team_id,
                gb.key,
                gb.gpu_hours,
                used / 3600.0,
                start,
                renews,
                gb.hard,
                gpu_type=gb.gpu_type,
            )
    return out


def budget_label(b: BudgetStatus) -> str:
    """``CRITICAL class``, ``monthly``, ``rolling H100``: a budget as a sentence names it."""
    if b.priority is not None:
        return f"{b.priority.value} class"
    period = "monthly" if b.key.endswith(":month") else "rolling-window"
    return f"{period} {b.gpu_type} GPU-hour" if b.gpu_type else f"{period} GPU-hour"


def soft_warning(b: BudgetStatus, *, exact: bool = True) -> str | None:
    """The warning of a soft GPU-hour budget at or over 80% (:data:`WARN_FRACTIONS`), else
    None (hard budgets and class budgets hold or demote instead: their own sentences).
    ``exact``: the percentage used (``submit``); else the threshold reached, a sentence that
    stays the same while the use grows (the scheduler's stored reasons)."""
    if b.hard or b.priority is not None or b.warning is None:
        return None
    used = (
        f"{b.fraction * 100:.0f}% ({gpu_h(b.used_gpu_h)} of {gpu_h(b.limit_gpu_h)} GPU-h)"
        if exact
        else ("all" if b.warning >= 1.0 else f"over {b.warning * 100:.0f}%")
    )
    return (
        f"team {b.team_id} has used {used} of its soft {budget_label(b)} budget; jobs still start"
    )


def any_soft_warning(statuses: Mapping[tuple[str, str], BudgetStatus]) -> bool:
    """Whether any soft GPU-hour budget in ``statuses`` is at 80% or more."""
    return any(soft_warning(b) is not None for b in statuses.values())


def soft_warnings(
    statuses: Mapping[tuple[str, str], BudgetStatus], team_id: str, *, exact: bool = True
) -> list[str]:
    """:func:`soft_warning` of each of ``team_id``'s budgets that warns, by budget key."""
    out: list[str] = []
    for (team, _), b in sorted(statuses.items()):
        if team == team_id and (w := soft_warning(b, exact=exact)) is not None:
            out.append(w)
    return out


def submit_warnings(
    statuses: Iterable[BudgetStatus], priority: PriorityClass, now_s: float
) -> list[str]:
    """What ``submit`` tells a job of ``priority`` about its team's budgets (``statuses``:
    the team's): each soft budget at 80% or more (the percentage used), each exhausted
    hard budget (the job waits until the renewal), and the job's class budget when used
    up (demoted or held until it renews). Empty when nothing is near a limit."""
    out: list[str] = []
    for b in statuses:
        if (w := soft_warning(b)) is not None:
            out.append(w)
        elif b.exhausted and b.priority is None and b.hard:
            out.append(
                f"team {b.team_id} has used its {budget_label(b)} budget"
                f" ({gpu_h(b.used_gpu_h)} of {gpu_h(b.limit_gpu_h)} GPU-h): the job waits"
                f" {_when(b.renews_at_s, now_s)}"
            )
        elif b.exhausted and b.priority is priority:
            what = "waits" if b.hard else "runs at NORMAL"
            out.append(
                f"team {b.team_id} has used its {priority.value} budget"
                f" ({gpu_h(b.used_gpu_h)} of {gpu_h(b.limit_gpu_h)} GPU-h): the job {what}"
                f" {_when(b.renews_at_s, now_s)}"
            )
    return out


def _when(at_s: float | None, now_s: float) -> str:
    if at_s is None:
        return "until an admin changes the team's limits"
    left = max(0.0, at_s - now_s)
    if left >= 86400:
        return f"until it renews in {left / 86400:.1f} d"
    if left >= 3600:
        return f"until it renews in {left / 3600:.1f} h"
    return f"until it renews in {left / 60:.0f} min"


def _budget_hold(job: PendingJob, blocking: list[BudgetStatus], now_s: float) -> WaitReason:
    # the job starts only once every blocking budget renewed: the LATEST renewal (one that
    # never renews by itself, None, comes last)
    b = max(
        blocking,
        key=lambda s: (float("inf") if s.renews_at_s is None else s.renews_at_s, s.key),
    )
    scope = f"{b.gpu_type} GPU-hour" if b.gpu_type else "GPU-hour"
    return WaitReason(
        "budget_exhausted",
        f"team {job.team_id} used its {scope} budget ({gpu_h(b.used_gpu_h)} of"
        f" {gpu_h(b.limit_gpu_h)} GPU-h in its period); new jobs wait"
        f" {_when(b.renews_at_s, now_s)}"
        " (running jobs are not stopped)",
        {
            "budget": b.key,
            "blocking": sorted(s.key for s in blocking),
            "used_gpu_h": round(b.used_gpu_h, 6),
            "limit_gpu_h": b.limit_gpu_h,
            "renews_at_s": b.renews_at_s,
        },
        estimated_start_s=b.renews_at_s,
    )


def _class_hold(job: PendingJob, b: BudgetStatus, now_s: float) -> WaitReason:
    return WaitReason(
        "class_budget_exhausted",
        f"team {job.team_id} used its {job.priority.value} budget ({gpu_h(b.used_gpu_h)} of"
        f" {gpu_h(b.limit_gpu_h)} GPU-h in the window); {job.priority.value} jobs wait"
        f" {_when(b.renews_at_s, now_s)}",
        {
            "budget": b.key,
            "priority": job.priority.value,
            "used_gpu_h": round(b.used_gpu_h, 6),
            "limit_gpu_h": b.limit_gpu_h,
            "renews_at_s": b.renews_at_s,
        },
        estimated_start_s=b.renews_at_s,
    )


def demotion_note(d: Demotion, now_s: float) -> str:
    """The sentence ``why`` adds for a demoted job."""
    if d.ground == "class_not_allowed":
        return (
            f"runs at {d.effective.value}, not {d.requested.value}: its team may not use"
            f" {d.requested.value} ({_when(d.until_s, now_s)})"
        )
    return (
        f"demoted from {d.requested.value} to {d.effective.value}: its team's"
        f" {d.requested.value} budget is used up, {_when(d.until_s, now_s)}"
    )


def with_demotion(reason: WaitReason, d: Demotion, now_s: float) -> WaitReason:
    """``reason`` with the demotion said in its sentence and ``details.demoted``."""
    return replace(
        reason,
        message=f"{reason.message.rstrip('.')}; {demotion_note(d, now_s)}",
        details={
            **dict(reason.details),
            "demoted": {
                "from": d.requested.value,
                "to": d.effective.value,
                "ground": d.ground,
                "until_s": d.until_s,
            },
        },
    )


def _job_types(job: PendingJob, fleet_types: Sequence[str]) -> tuple[str, ...]:
    return tuple(job.resources.gpu_types) if job.resources.gpu_types else tuple(fleet_types)


def apply_limits(
    snapshot: ClusterSnapshot,
    limits: Mapping[str, TeamLimits],
    ledger: Mapping[tuple[str, str], LedgerUse],
    config: PolicyConfig,
) -> LimitsResult:
    """The snapshot a pass should see under the teams' limits, and what was done.

    * a job of a class its team may not use runs at :func:`demotion_target`;
    * a job of a class over its budget runs at NORMAL (``over=demote``) or waits
      (``class_budget_exhausted``, ``over=hold``);
    * a job whose every acceptable GPU type is under an exhausted hard budget (a total
      budget covers every type) waits (``budget_exhausted``, with the renewal time); a job
      that may also run on a type still within budget is offered on those types only.

    Deterministic; teams without limits are left as they are (their queues untouched).
    """
    active = {t: lim for t, lim in limits.items() if not lim.empty}
    if not active:
        return LimitsResult(snapshot)
    statuses = budget_statuses(snapshot, active, ledger)
    now = snapshot.now_s
    fleet_types = sorted({n.gpu_type for n in snapshot.nodes})
    demoted: dict[str, Demotion] = {}
    held: dict[str, WaitReason] = {}
    # per team: exhausted class budgets and exhausted hard budgets (by GPU type)
    plans: dict[str, tuple[dict[PriorityClass, BudgetStatus], list[BudgetStatus]]] = {}
    for team_id, lim in active.items():
        classes = {
            st.priority: st
            for cb in lim.class_budgets
            if (st := statuses[(team_id, cb.key)]).exhausted and st.priority is not None
        }
        hard = [
            st
            for gb in lim.gpu_budgets
            if gb.hard and (st := statuses[(team_id, gb.key)]).exhausted
        ]
        if classes or hard or lim.allowed_classes is not None:
            plans[team_id] = (classes, hard)
    if not plans:
        return LimitsResult(snapshot, statuses=statuses)

    def adjust(job: PendingJob) -> PendingJob | None:
        lim = active[job.team_id]
        classes, hard = plans[job.team_id]
        if hard:
            if any(b.gpu_type is None for b in hard):
                held[job.job_id] = _budget_hold(job, hard, now)
                return None
            spent = {b.gpu_type for b in hard}
            types = _job_types(job, fleet_types)
            left = tuple(t for t in types if t not in spent)
            if not left:
                held[job.job_id] = _budget_hold(job, hard, now)
                return None
            if left != types:
                job = replace(job, resources=replace(job.resources, gpu_types=left))
        prio = job.priority
        allowed = lim.allowed_classes
        if allowed is not None and prio not in allowed:
            target = demotion_target(allowed)
            demoted[job.job_id] = Demotion(job.job_id, prio, target, "class_not_allowed")
            return replace(job, priority=target)
        b = classes.get(prio)
        if b is None:
            return job
        cb = next(c for c in lim.class_budgets if c.priority is prio)
        if cb.over is OverBudget.HOLD:
            held[job.job_id] = _class_hold(job, b, now)
            return None
        target = PriorityClass.NORMAL
        demoted[job.job_id] = Demotion(job.job_id, prio, target, "class_budget", b.renews_at_s)
        return replace(job, priority=target)

    if snapshot.queues is not None:
        key = queue_key(config)
        queues: dict[str, Sequence[PendingJob]] = dict(snapshot.queues)
        for team_id in plans:
            q = queues.get(team_id)
            if not q:
                continue
            out = _adjusted(q, adjust)
            if out is not None:
                queues[team_id] = sorted(out, key=key)
        snap = replace(snapshot, queues=queues)
    else:
        pending: list[PendingJob] = []
        for job in snapshot.pending:
            if job.team_id in plans:
                new = adjust(job)
                if new is not None:
                    pending.append(new)
            else:
                pending.append(job)
        snap = replace(snapshot, pending=tuple(pending))
    if held:
        gone = frozenset(held)
        snap = replace(
            snap,
            holds=tuple(h for h in snap.holds if h.job_id not in gone),
            reservations=tuple(r for r in snap.reservations if r.job_id not in gone),
        )
    return LimitsResult(snap, demoted, held, statuses)


def _adjusted(
    queue: Iterable[PendingJob], adjust: Callable[[PendingJob], PendingJob | None]
) -> list[PendingJob] | None:
    """The queue with ``adjust`` applied, or None when nothing changed (kept as it is)."""
    out: list[PendingJob] = []
    changed = False
    for job in queue:
        new = adjust(job)
        if new is not job:
            changed = True
        if new is not None:
            out.append(new)
    return out if changed else None
