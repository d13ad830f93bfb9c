"""Exec sessions into running jobs: which attempt, on which agent, and their audit events.

The rules are docs/design/security.md, "Getting into a running job". The API server asks
:func:`exec_target` (the team's own job only; another team's is NotFound, as on every job
route), dials the agent with its ``api`` certificate, and records :func:`record_exec` events
(``exec_started`` / ``exec_ended``) on the job's audit trail.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from gpufleet.domain.errors import Conflict
from gpufleet.services import jobctl
from gpufleet.services.job_queries import get_job
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRunRow, NodeRow
from gpufleet.store.transitions import record_event


@dataclass(frozen=True, slots=True)
class ExecTarget:
    """The running attempt (gang member ``rank``) of a job and its agent's gRPC address."""

    job_id: str
    run_id: str
    token: int
    rank: int
    node_id: str
    address: str


def exec_target(db: Database, team_id: str | None, ref: str, rank: int = 0) -> ExecTarget:
    """Where an exec into job ``ref`` (id, prefix or name) goes. ``team_id=None``: an admin.

    Raises:
        NotFound: no such job in the team (404).
        Conflict: it has no RUNNING attempt of that rank (409, field ``rank`` when the rank
            is out of the gang).
    """
    job_id = jobctl.resolve(db, team_id, ref)
    with db.read() as s:
        job, _runs = get_job(s, team_id, job_id)
        run = s.scalars(
            select(JobRunRow).where(
                JobRunRow.job_id == job_id,
                JobRunRow.rank == rank,
                JobRunRow.status == "RUNNING",
            )
        ).first()
        if run is None:
            raise Conflict(
                f"job {job_id} has no running attempt"
                + (f" of rank {rank}" if rank else "")
                + f" (it is {job.status})",
                field="rank" if rank else "job_id",
            )
        node = s.get(NodeRow, run.node_id)
        if node is None or not node.address:
            raise Conflict(f"job {job_id}: its node {run.node_id} has no agent address")
        return ExecTarget(job_id, run.id, run.token, run.rank, run.node_id, node.address)


def record_exec(
    db: Database, target: ExecTarget, kind: str, message: str, details: Mapping[str, Any]
) -> None:
    """Append one ``exec_started`` / ``exec_ended`` event to the job's audit trail."""

    def write(s: Any) -> None:
        record_event(
            s,
            kind,
            message=message,
            job_id=target.job_id,
            run_id=target.run_id,
            node_id=target.node_id,
            details=details,
        )

    db.run_write(write)
