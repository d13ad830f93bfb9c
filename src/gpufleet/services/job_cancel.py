"""Cancel a job (seed Phase 4): a PENDING job at once, a job with an attempt by request
(the controller stops the attempt, then releases its GPUs).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, NotFound, StaleState
from gpufleet.domain.states import JOB_TERMINAL, JobStatus, Machine
from gpufleet.services.job_queries import is_job_id
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow
from gpufleet.store.transitions import record_event, transition


def cancel_job(db: Database, team_id: str | None, job_id: str) -> str:
    """:func:`cancel_job_outcome`'s status after the request."""
    return cancel_job_outcome(db, team_id, job_id)[0]


def cancel_job_outcome(db: Database, team_id: str | None, job_id: str) -> tuple[str, bool]:
    """Request cancellation; returns the job's status after the request and whether it was
    already CANCELLED before it (nothing done).

    PENDING jobs are CANCELLED at once. Jobs with an attempt get ``cancel_requested``; the
    controller stops the attempt (SIGTERM, grace, SIGKILL, verified) and only then releases
    its GPUs and marks the job CANCELLED. Cancelling a CANCELLED job again is a no-op; a job
    that already SUCCEEDED, FAILED or EXPIRED raises Conflict (409 job_already_finished).
    """

    def tx(session: Session) -> tuple[str, bool]:
        job = session.get(JobRow, job_id, with_for_update=True) if is_job_id(job_id) else None
        if job is None or (team_id is not None and job.team_id != team_id):
            raise NotFound(f"no job {job_id!r}", field="job_id")
        if job.status == JobStatus.CANCELLED:
            return job.status, True  # a repeated cancel (a client retry) is not an error
        if job.status in JOB_TERMINAL:
            raise Conflict(
                f"job {job_id} already finished ({job.status})",
                field="job_id",
                code="job_already_finished",
            )
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
            return JobStatus.CANCELLED, False
        job.cancel_requested = True
        record_event(
            session,
            "cancel_requested",
            now=now,
            message="cancel requested by user",
            job_id=job_id,
            run_id=job.current_run_id,
        )
        return job.status, False

    try:
        return db.run_write(tx)
    except StaleState:
        return db.run_write(tx)
