"""Team limits as the policy reads them: ``teams.limits`` and the ledger's use per window.

``teams.limits`` (JSON, written by ``services.team_limits`` after validation)::

    {"allowed_classes": ["NORMAL", "LOW"], "disallowed": "refuse",
     "class_budgets": {"CRITICAL": {"gpu_hours": 50, "window_s": 604800, "over": "demote"}},
     "gpu_budgets": [{"gpu_hours": 1000, "period": "month", "gpu_type": null, "hard": true}],
     "preemption_waste": {"gpu_hours": 20, "window_s": 86400}}

:func:`ledger_use` sums ``usage_records`` per (team, budget) window: per team and distinct
window start, one GROUP BY over the team's records ending inside it
(``ix_usage_records_team_end_at``) of the records that start inside, plus the few that
straddle the start (clipped here); for a budget at least half used, the ``(end, GPU-s)``
pairs that date its renewal (one more indexed read of that window). Only teams with a budget
are read; the scheduler keeps the answer for ``LEDGER_REFRESH_S`` (the running attempts'
part is added by the policy in every pass, exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.states import RunStatus
from gpufleet.domain.types import PriorityClass
from gpufleet.policy.limits import (
    BudgetStatus,
    ClassBudget,
    Disallowed,
    GpuBudget,
    LedgerUse,
    OverBudget,
    Period,
    TeamLimits,
    statuses_at,
)
from gpufleet.policy.snapshot import RunningJob
from gpufleet.policy.waste import DEFAULT_WINDOW_S, WasteLimit
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, TeamRow, UsageRecordRow

__all__ = ["LEDGER_REFRESH_S", "ledger_use", "limits_from_json", "team_budgets"]

_LIVE_RUNS = (RunStatus.ASSIGNED, RunStatus.RUNNING, RunStatus.PREEMPTING)

LEDGER_REFRESH_S = 30.0


def limits_from_json(raw: Mapping[str, Any] | None) -> TeamLimits:
    """The stored JSON as a ``TeamLimits`` (None or ``{}``: no limits)."""
    if not raw:
        return TeamLimits()
    allowed = raw.get("allowed_classes")
    return TeamLimits(
        allowed_classes=frozenset(PriorityClass(p) for p in allowed)
        if allowed is not None
        else None,
        disallowed=Disallowed(raw.get("disallowed", "refuse")),
        class_budgets=tuple(
            ClassBudget(
                PriorityClass(cls),
                float(b["gpu_hours"]),
                float(b["window_s"]),
                OverBudget(b.get("over", "demote")),
            )
            for cls, b in sorted((raw.get("class_budgets") or {}).items())
        ),
        gpu_budgets=tuple(
            GpuBudget(
                float(b["gpu_hours"]),
                Period(b.get("period", "month")),
                float(b["window_s"]) if b.get("window_s") is not None else None,
                b.get("gpu_type"),
                bool(b.get("hard", False)),
            )
            for b in raw.get("gpu_budgets") or ()
        ),
        preemption_waste=WasteLimit(
            float(raw["preemption_waste"]["gpu_hours"]),
            float(raw["preemption_waste"].get("window_s", DEFAULT_WINDOW_S)),
        )
        if raw.get("preemption_waste")
        else None,
    )


def _ts(now_s: float) -> datetime:
    return datetime.fromtimestamp(now_s, UTC)


def _epoch(dt: datetime) -> float:
    return (dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)).timestamp()


def ledger_use(
    session: Session, limits: Mapping[str, TeamLimits], now_s: float
) -> dict[tuple[str, str], LedgerUse]:
    """``(team, budget key) -> LedgerUse`` of every budget in ``limits`` at ``now_s``."""
    out: dict[tuple[str, str], LedgerUse] = {}
    u = UsageRecordRow
    for team_id, lim in sorted(limits.items()):
        windows: dict[float, list[tuple[str, ClassBudget | GpuBudget]]] = {}
        for cb in lim.class_budgets:
            windows.setdefault(now_s - cb.window_s, []).append((cb.key, cb))
        for gb in lim.gpu_budgets:
            ws, _ = lim.window(gb.key, now_s)
            windows.setdefault(ws, []).append((gb.key, gb))
        for ws, budgets in windows.items():
            start = _ts(ws)
            inside = session.execute(
                select(u.priority, u.gpu_type, func.sum(u.gpu_seconds))
                .where(u.team_id == team_id, u.end_at > start, u.start_at >= start)
                .group_by(u.priority, u.gpu_type)
            ).all()
            straddle = session.execute(
                select(u.priority, u.gpu_type, u.end_at, u.gpus).where(
                    u.team_id == team_id, u.end_at > start, u.start_at < start
                )
            ).all()
            sums: dict[tuple[str | None, str], float] = {}
            for prio, gpu_type, gpu_s in inside:
                sums[(prio, gpu_type)] = sums.get((prio, gpu_type), 0.0) + float(gpu_s or 0.0)
            for prio, gpu_type, end_at, gpus in straddle:
                part = gpus * max(0.0, _epoch(end_at) - ws)
                sums[(prio, gpu_type)] = sums.get((prio, gpu_type), 0.0) + part
            for key, b in budgets:
                if isinstance(b, ClassBudget):
                    used = sum(v for (p, _), v in sums.items() if p == b.priority.value)
                    window_s: float | None = b.window_s
                    where: list[Any] = [u.priority == b.priority.value]
                else:
                    used = sum(
                        v for (_, t), v in sums.items() if b.gpu_type is None or t == b.gpu_type
                    )
                    window_s = b.window_s if b.period is Period.ROLLING else None
                    where = [u.gpu_type == b.gpu_type] if b.gpu_type is not None else []
                releases: list[tuple[float, float]] = []
                if window_s is not None and used >= 0.5 * b.gpu_hours * 3600.0:
                    rows = session.execute(
                        select(u.start_at, u.end_at, u.gpus)
                        .where(u.team_id == team_id, u.end_at > start, *where)
                        .order_by(u.end_at)
                    ).all()
                    for s_at, e_at, gpus in rows:
                        end = _epoch(e_at)
                        releases.append((end, gpus * max(0.0, end - max(_epoch(s_at), ws))))
                out[(team_id, key)] = LedgerUse(used, releases)
    return out


def running_attempts(session: Session, team_ids: list[str]) -> list[RunningJob]:
    """The attempts of ``team_ids`` that have not ended (one row per gang member), as the
    policy's budget arithmetic reads them (team, class placed at, GPUs, type, start)."""
    if not team_ids:
        return []
    rows = session.execute(
        select(
            JobRunRow.id,
            JobRunRow.job_id,
            JobRow.team_id,
            JobRunRow.node_id,
            JobRunRow.priority,
            JobRow.priority,
            JobRunRow.gpu_ids,
            NodeRow.gpu_type,
            JobRunRow.started_at,
            JobRunRow.created_at,
        )
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .where(JobRow.team_id.in_(team_ids), JobRunRow.status.in_(_LIVE_RUNS))
    ).all()
    return [
        RunningJob(
            run_id=run_id,
            job_id=job_id,
            team_id=team_id,
            node_id=node_id,
            priority=PriorityClass(placed or asked),
            gpu_count=len(gpu_ids or ()),
            gpu_type=gpu_type,
            started_at_s=_epoch(started_at or created_at),
        )
        for (
            run_id,
            job_id,
            team_id,
            node_id,
            placed,
            asked,
            gpu_ids,
            gpu_type,
            started_at,
            created_at,
        ) in rows
    ]


def team_budgets(session: Session, team_id: str | None, now_s: float) -> list[BudgetStatus]:
    """Every budget (class and GPU-hour) of ``team_id`` (None: of every team) at ``now_s``:
    the ledger's use in its window plus the running attempts' elapsed part, ordered by team
    and budget key. Teams without budgets read nothing more than their ``limits``."""
    q = select(TeamRow.id, TeamRow.limits)
    if team_id is not None:
        q = q.where(TeamRow.id == team_id)
    limits = {
        t: lim
        for t, raw in session.execute(q).all()
        if (lim := limits_from_json(raw)).class_budgets or lim.gpu_budgets
    }
    if not limits:
        return []
    ledger = ledger_use(session, limits, now_s)
    running = running_attempts(session, sorted(limits))
    found = statuses_at(now_s, running, limits, ledger)
    return [found[k] for k in sorted(found)]
