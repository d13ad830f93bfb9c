"""Read jobs (seed Phase 4): one job with its attempts, a page of a team's jobs, a pending
job's place in its team's queue, a job's events, the attempts whose processes may still run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import NotFound, ValidationFailed
from gpufleet.domain.states import JobStatus, ReservationStatus, RunStatus
from gpufleet.store.tables import JobRow, JobRunRow, ReservationRow, SchedulingEventRow

JOB_ID = re.compile(r"^j-[0-9a-z]{26}$")


def is_job_id(value: str) -> bool:
    """Whether ``value`` has the shape of a job id (anything else cannot exist: 404 early,
    and never send odd bytes such as NUL to the database)."""
    return bool(JOB_ID.match(value))


def get_job(session: Session, team_id: str | None, job_id: str) -> tuple[JobRow, list[JobRunRow]]:
    """The job and its attempts (oldest first). Another team's job is NotFound (404), as if
    it did not exist; ``team_id=None`` (admin) sees all."""
    job = session.get(JobRow, job_id) if is_job_id(job_id) else None
    if job is None or (team_id is not None and job.team_id != team_id):
        raise NotFound(f"no job {job_id!r}", field="job_id")
    runs = list(
        session.scalars(
            select(JobRunRow)
            .where(JobRunRow.job_id == job_id)
            .order_by(JobRunRow.attempt, JobRunRow.rank)
        )
    )
    return job, runs


def unverified_processes(session: Session, runs: Iterable[JobRunRow]) -> dict[str, str]:
    """Run id -> why its processes may still be running, for each of ``runs`` that was
    FENCED (its node went silent, lost its agent's state or was fenced by an operator)
    while nobody has said its processes are gone: its reservation is still QUARANTINED
    (released when the agent reports the run gone or an operator confirms the node dead).
    Its job may already show CANCELLED or run elsewhere; this says the old attempt's code
    may run on (issue 24, item 6). One indexed read, only when an attempt was fenced."""
    fenced = [r.id for r in runs if r.status == RunStatus.FENCED]
    if not fenced:
        return {}
    rows = session.execute(
        select(ReservationRow.run_id, ReservationRow.node_id).where(
            ReservationRow.run_id.in_(fenced),
            ReservationRow.status == ReservationStatus.QUARANTINED,
        )
    ).all()
    return {
        run_id: f"processes not verified gone: node {node_id} unreachable (its GPUs stay"
        " quarantined until its agent reports them stopped or an operator confirms the"
        " node dead)"
        for run_id, node_id in rows
    }


def list_jobs(
    session: Session,
    team_id: str | None,
    *,
    status: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
    array_id: str | None = None,
    name: str | None = None,
    owner: str | None = None,
    name_contains: str | None = None,
) -> tuple[list[JobRow], str | None]:
    """Newest first; ``cursor`` is the last job id of the previous page (ids sort by time).
    ``status``: one status or a comma list (``PENDING,RUNNING``: any of them);
    ``array_id``/``name``/``owner``: only that array's tasks / jobs of that name / jobs
    that user submitted; ``name_contains``: jobs whose name contains this text
    (case-insensitive; ``%`` and ``_`` match themselves).

    Raises:
        ValidationFailed: an unknown status (field ``status``) or a bad cursor.
    """
    q = select(JobRow).order_by(JobRow.id.desc()).limit(limit + 1)
    if team_id is not None:
        q = q.where(JobRow.team_id == team_id)
    if array_id is not None:
        q = q.where(JobRow.array_id == array_id)
    if name is not None:
        q = q.where(JobRow.name == name)
    if owner is not None:
        q = q.where(JobRow.owner == owner)
    if name_contains:
        pattern = name_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        q = q.where(JobRow.name.ilike(f"%{pattern}%", escape="\\"))
    if status is not None:
        wanted = [part.strip() for part in status.split(",")]
        for one in wanted:
            if one not in JobStatus.__members__:
                raise ValidationFailed(f"unknown status {one!r}", field="status")
        q = q.where(JobRow.status.in_(wanted))
    if cursor:
        if not is_job_id(cursor):
            raise ValidationFailed(
                "cursor is not a next_cursor value from this API", field="cursor"
            )
        q = q.where(JobRow.id < cursor)
    rows = list(session.scalars(q))
    next_cursor = rows[limit - 1].id if len(rows) > limit else None
    return rows[:limit], next_cursor


def queue_position(session: Session, job: JobRow) -> int:
    """1-based position of a PENDING job in its team's queue: priority class, then the time
    it (re-)entered the queue, then id, as ``policy.priority.queue_order_key`` (SQLite's clock
    has millisecond resolution, so two submits can share a ``queued_at``). (The policy's
    aging credit can reorder jobs of different classes that waited long; this is the order
    without it.)"""
    ahead = session.execute(
        select(func.count())
        .select_from(JobRow)
        .where(
            JobRow.team_id == job.team_id,
            JobRow.status == JobStatus.PENDING,
            JobRow.cancel_requested.is_(False),
            (JobRow.priority_rank > job.priority_rank)
            | (
                (JobRow.priority_rank == job.priority_rank)
                & (
                    (JobRow.queued_at < job.queued_at)
                    | ((JobRow.queued_at == job.queued_at) & (JobRow.id < job.id))
                )
            ),
        )
    ).scalar_one()
    return int(ahead) + 1


def job_events(session: Session, job_id: str, limit: int = 200) -> list[SchedulingEventRow]:
    return list(
        session.scalars(
            select(SchedulingEventRow)
            .where(SchedulingEventRow.job_id == job_id)
            .order_by(SchedulingEventRow.id)
            .limit(limit)
        )
    )


def iso(ts: datetime | None) -> str | None:
    return ts.isoformat().replace("+00:00", "Z") if ts else None


def run_times(
    job: JobRow, runs: list[JobRunRow], now: datetime | None
) -> tuple[float | None, float | None]:
    """(elapsed, left) in seconds: how long the job's latest attempt has run (to its end, or
    to ``now``, the database's clock, while it runs; None if it never started), and, while
    the job is RUNNING with a ``max_runtime_s``, how much of that limit is left (>= 0; the
    limit applies per attempt, as ``controller.stops`` enforces it). Both None without
    ``now``."""
    if now is None:
        return None, None
    started = [(r.attempt, r.started_at, r) for r in runs if r.started_at is not None]
    if not started:
        return None, None
    _, start, last = max(started, key=lambda t: (t[0], t[1]))
    # a finished attempt's end; while the job runs, now; else (a member still marked
    # running of a finished job) the job's end
    end = last.finished_at or (now if job.status == "RUNNING" else job.finished_at) or now
    elapsed = max(0.0, (_utc(end) - _utc(start)).total_seconds())
    limit = job.max_runtime_s if job.max_runtime_s is not None else job.spec.get("max_runtime_s")
    left = max(0.0, float(limit) - elapsed) if limit and job.status == "RUNNING" else None
    return round(elapsed, 3), None if left is None else round(left, 3)


def _utc(at: datetime) -> datetime:
    """SQLite hands back naive datetimes (UTC): make every one aware for arithmetic."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
