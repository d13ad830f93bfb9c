"""The work lost to preemption, as the preemption waste cap (``policy.waste``) and the usage
report read it.

A run stopped for a preemption (``job_runs.stop_reason = 'preempt'``: priority, reclaim, srtf
or defragment, ``preempt_reason``) lost its GPUs x the time from the later of its start and
its last reported checkpoint (``last_checkpoint_at``) to ``stop_requested_at``: the same
measure as ``store.queries.recent_displacements`` and the victim cost of
``policy.preemption``. One indexed range read (``ix_job_runs_stop_requested_at``) joined to
the job for its team.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.policy.limits import TeamLimits
from gpufleet.policy.waste import Waste, WasteState
from gpufleet.store.dialect import as_utc
from gpufleet.store.tables import JobRow, JobRunRow

__all__ = ["recent_waste", "waste_per_team", "waste_state", "wasted"]


def recent_waste(session: Session, now: datetime, window_s: float) -> tuple[Waste, ...]:
    """The preempted runs told to stop in the last ``window_s`` seconds before ``now``, oldest
    first, as ``Waste(team_id, at_s, gpu_hours)`` (``at_s`` unix seconds)."""
    return wasted(session, now - timedelta(seconds=window_s), None)


def wasted(
    session: Session, since: datetime | None, until: datetime | None, team: str | None = None
) -> tuple[Waste, ...]:
    """The preempted runs told to stop in ``[since, until)`` (None: open), of one ``team``
    or all, oldest first."""
    query = (
        select(
            JobRow.team_id,
            JobRunRow.stop_requested_at,
            JobRunRow.started_at,
            JobRunRow.created_at,
            JobRunRow.last_checkpoint_at,
            JobRunRow.gpu_ids,
        )
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .where(JobRunRow.stop_requested_at.is_not(None), JobRunRow.stop_reason == "preempt")
        .order_by(JobRunRow.stop_requested_at, JobRunRow.id)
    )
    if since is not None:
        query = query.where(JobRunRow.stop_requested_at >= since)
    if until is not None:
        query = query.where(JobRunRow.stop_requested_at < until)
    if team is not None:
        query = query.where(JobRow.team_id == team)
    out = []
    for r in session.execute(query).all():
        at = as_utc(r.stop_requested_at).timestamp()
        began = as_utc(r.started_at or r.created_at).timestamp()
        if r.last_checkpoint_at is not None:
            began = max(began, as_utc(r.last_checkpoint_at).timestamp())
        out.append(Waste(r.team_id, at, len(r.gpu_ids or ()) * max(0.0, at - began) / 3600.0))
    return tuple(out)


def waste_state(
    session: Session,
    now: datetime,
    team_limits: Mapping[str, TeamLimits],
    fleet_window_s: float | None,
) -> WasteState | None:
    """The pass's ``ClusterSnapshot.preemption_waste``: the losses of the longest window in
    force and the teams' caps; None when no team has a cap and the fleet has none
    (``fleet_window_s`` None)."""
    caps = {t: lim.preemption_waste for t, lim in team_limits.items() if lim.preemption_waste}
    windows = [c.window_s for c in caps.values() if c is not None]
    if fleet_window_s is not None:
        windows.append(fleet_window_s)
    if not windows:
        return None
    return WasteState(
        recent_waste(session, now, max(windows)),
        {t: c for t, c in caps.items() if c is not None},
    )


def waste_per_team(
    session: Session, since: datetime | None, until: datetime | None, team: str | None = None
) -> dict[str, float]:
    """GPU-hours lost to preemption per victim team, stops requested in ``[since, until)``."""
    out: dict[str, float] = {}
    for w in wasted(session, since, until, team):
        out[w.team_id] = out.get(w.team_id, 0.0) + w.gpu_hours
    return out
