"""Submit, read, list and cancel jobs (seed Phase 1 and Phase 4).

Submit: validate -> INSERT job (PENDING) -> commit -> wake the scheduler -> 201. The job row is
the truth; the wake-up is a hint sent after commit. Idempotency: ``(team_id, key)`` is unique
and bound to the sha256 of the normalized spec; the same key with another payload is 409.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpufleet.domain.errors import (
    IdempotencyKeyReused,
    LimitExceeded,
    NotFound,
    StaleState,
    ValidationFailed,
)
from gpufleet.domain.ids import new_job_id
from gpufleet.domain.states import JOB_TERMINAL, JobStatus, Machine
from gpufleet.domain.types import JobSpec
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import (
    JobRow,
    JobRunRow,
    NodeCapacityRow,
    NodeRow,
    SchedulingEventRow,
    TeamRow,
)
from gpufleet.store.transitions import record_event, transition


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    data = asdict(spec)
    data["command"] = list(spec.command)
    data["resources"]["gpu_types"] = list(spec.resources.gpu_types)
    data["env"] = dict(spec.env)
    data["node_selector"] = dict(spec.node_selector)
    data["priority"] = spec.priority.value
    return data


def payload_sha256(spec: JobSpec) -> str:
    canonical = json.dumps(spec_to_dict(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Submitted:
    job_id: str
    status: str
    created: bool
    """False when an earlier submission with the same key and payload was returned."""


def check_fits_fleet(session: Session, spec: JobSpec, fallback_max_gpus: int) -> None:
    """Reject a job no registered node type could ever hold. With no node registered yet,
    bound gpu_count by ``fallback_max_gpus``. Raises ValidationFailed(field=...)."""
    res = spec.resources
    q = select(func.max(NodeCapacityRow.total_gpus)).join(
        NodeRow, NodeRow.id == NodeCapacityRow.node_id
    )
    any_node = session.execute(select(func.count()).select_from(NodeRow)).scalar_one() > 0
    if res.gpu_types:
        q = q.where(NodeRow.gpu_type.in_(res.gpu_types))
    if res.gpu_memory_mb:
        q = q.where(NodeRow.gpu_memory_mb >= res.gpu_memory_mb)
    largest = session.execute(q).scalar_one_or_none()
    if not any_node:
        if res.gpu_count > fallback_max_gpus:
            raise ValidationFailed(
                f"gpu_count {res.gpu_count} exceeds the largest node size ({fallback_max_gpus})",
                field="gpu_count",
            )
        return
    if largest is None:
        types = "/".join(res.gpu_types) or "any type"
        raise ValidationFailed(
            f"no node has GPUs of {types}"
            + (f" with >= {res.gpu_memory_mb} MiB" if res.gpu_memory_mb else ""),
            field="gpu_type" if res.gpu_types else "gpu_memory_mb",
        )
    if res.gpu_count > largest:
        raise ValidationFailed(
            f"gpu_count {res.gpu_count} exceeds the largest matching node ({largest} GPUs);"
            " a job runs on one node",
            field="gpu_count",
        )


def check_outstanding_limit(session: Session, team_id: str) -> None:
    """Raise LimitExceeded (429) when the team already has ``max_outstanding_jobs`` jobs that
    are not finished. Admission control, separate from fair share of admitted work."""
    limit = session.execute(
        select(TeamRow.max_outstanding_jobs).where(TeamRow.id == team_id)
    ).scalar_one_or_none()
    if not limit:
        return
    open_jobs = session.execute(
        select(func.count())
        .select_from(JobRow)
        .where(JobRow.team_id == team_id, JobRow.status.not_in(list(JOB_TERMINAL)))
    ).scalar_one()
    if open_jobs >= limit:
        raise LimitExceeded(
            f"team {team_id!r} has {open_jobs} unfinished jobs (limit {limit}); retry later",
            field="max_outstanding_jobs",
        )


def submit_job(
    db: Database,
    *,
    team_id: str,
    idempotency_key: str,
    spec: JobSpec,
    fallback_max_gpus: int = 8,
) -> Submitted:
    """Persist a new PENDING job, or return the earlier one for a repeated key.

    Raises:
        IdempotencyKeyReused: same key, different payload (409).
        ValidationFailed: the job can never fit the fleet (422, names the field).
    """
    digest = payload_sha256(spec)

    def existing(session: Session) -> Submitted | None:
        row = session.execute(
            select(JobRow.id, JobRow.status, JobRow.payload_sha256).where(
                JobRow.team_id == team_id, JobRow.idempotency_key == idempotency_key
            )
        ).first()
        if row is None:
            return None
        if row.payload_sha256 != digest:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {idempotency_key!r} was used for a different job ({row.id})",
                field="Idempotency-Key",
            )
        return Submitted(row.id, row.status, created=False)

    with db.read() as session:
        found = existing(session)
        if found is not None:
            return found
        check_fits_fleet(session, spec, fallback_max_gpus)
        check_outstanding_limit(session, team_id)
    try:
        with db.write_tx() as session:
            now = db_now(session)
            job_id = new_job_id()
            session.add(
                JobRow(
                    id=job_id,
                    team_id=team_id,
                    name=spec.name,
                    idempotency_key=idempotency_key,
                    payload_sha256=digest,
                    spec=spec_to_dict(spec),
                    priority=spec.priority.value,
                    priority_rank=spec.priority.rank,
                    gpu_count=spec.resources.gpu_count,
                    status=JobStatus.PENDING,
                    cancel_requested=False,
                    fencing_epoch=0,
                    attempts=0,
                    created_at=now,
                    queued_at=now,
                )
            )
        return Submitted(job_id, JobStatus.PENDING, created=True)
    except IntegrityError:
        # A concurrent retry with the same key committed first: answer with its job.
        with db.read() as session:
            found = existing(session)
        if found is None:
            raise
        return found


def get_job(session: Session, team_id: str | None, job_id: str) -> tuple[JobRow, list[JobRunRow]]:
    """The job and its attempts (oldest first). Another team's job is NotFound (404), as if
    it did not exist; ``team_id=None`` (admin) sees all."""
    job = session.get(JobRow, job_id)
    if job is None or (team_id is not None and job.team_id != team_id):
        raise NotFound(f"no job {job_id!r}", field="job_id")
    runs = list(
        session.scalars(
            select(JobRunRow).where(JobRunRow.job_id == job_id).order_by(JobRunRow.attempt)
        )
    )
    return job, runs


def list_jobs(
    session: Session,
    team_id: str | None,
    *,
    status: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[JobRow], str | None]:
    """Newest first; ``cursor`` is the last job id of the previous page (ids sort by time)."""
    q = select(JobRow).order_by(JobRow.id.desc()).limit(limit + 1)
    if team_id is not None:
        q = q.where(JobRow.team_id == team_id)
    if status is not None:
        if status not in JobStatus.__members__:
            raise ValidationFailed(f"unknown status {status!r}", field="status")
        q = q.where(JobRow.status == status)
    if cursor:
        q = q.where(JobRow.id < cursor)
    rows = list(session.scalars(q))
    next_cursor = rows[limit - 1].id if len(rows) > limit else None
    return rows[:limit], next_cursor


def cancel_job(db: Database, team_id: str | None, job_id: str) -> str:
    """Request cancellation; returns the job's status after the request.

    PENDING jobs are CANCELLED at once. Jobs with an attempt get ``cancel_requested``; the
    controller stops the attempt (SIGTERM, grace, SIGKILL, verified) and only then releases
    its GPUs and marks the job CANCELLED. Terminal jobs are left as they are (idempotent).
    """

    def tx(session: Session) -> str:
        job = session.get(JobRow, job_id, with_for_update=True)
        if job is None or (team_id is not None and job.team_id != team_id):
            raise NotFound(f"no job {job_id!r}", field="job_id")
        if job.status in JOB_TERMINAL:
            return job.status
        now = db_now(session)
        if job.status == JobStatus.PENDING:
            transition(
                session,
                Machine.JOB,
                job_id,
                JobStatus.CANCELLED,
                now=now,
                frm=[JobStatus.PENDING],
                values={"cancel_requested": True, "finished_at": now, "pending_reason": None},
                message="cancelled by user while pending",
                job_id=job_id,
            )
            return JobStatus.CANCELLED
        job.cancel_requested = True
        record_event(
            session,
            "cancel_requested",
            now=now,
            message="cancel requested by user",
            job_id=job_id,
            run_id=job.current_run_id,
        )
        return job.status

    try:
        return db.run_write(tx)
    except StaleState:
        return db.run_write(tx)


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
