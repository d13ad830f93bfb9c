"""The store side of ``policy.gates``: read the gates of pending jobs, and end the jobs whose
dependencies can never be satisfied.

Only PENDING rows with ``gated`` set are read (index ``ix_jobs_status_gated``), so a queue of
10,000 ungated jobs costs one empty index lookup per pass.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import StaleState
from gpufleet.domain.states import RESERVATION_ACTIVE, JobStatus, Machine, ReservationStatus
from gpufleet.policy import gates
from gpufleet.policy.snapshot import ClusterSnapshot
from gpufleet.store.tables import JobRow, ReservationRow
from gpufleet.store.transitions import transition

CHUNK = 500
ACTIVE = (JobStatus.SCHEDULED, JobStatus.RUNNING)


@dataclass(frozen=True, slots=True)
class Gated:
    snapshot: ClusterSnapshot
    """The input snapshot without blocked or failed jobs."""
    result: gates.GateResult


def parse_dependencies(raw: Any) -> tuple[gates.Dependency, ...]:
    """The stored ``depends_on`` JSON as Dependency values (unknown kinds are skipped)."""
    out = []
    for item in raw or ():
        try:
            out.append(gates.Dependency(gates.DependencyKind(item["type"]), str(item["job_id"])))
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(out)


def load_gates(session: Session, pending_ids: Container[str] | None = None) -> list[gates.JobGate]:
    """The gates of gated PENDING jobs (only those in ``pending_ids`` when given)."""
    rows = (
        session.connection()
        .execute(  # Core rows: no ORM loading cost per row
            select(
                JobRow.id,
                JobRow.held,
                JobRow.depends_on,
                JobRow.array_id,
                JobRow.array_index,
                JobRow.array_max_running,
            ).where(JobRow.status == JobStatus.PENDING, JobRow.gated.is_(True))
        )
        .all()
    )
    make = gates.JobGate
    return [
        make(
            job_id,
            bool(held),
            parse_dependencies(deps) if deps else (),
            array_id,
            index or 0,
            max_running,
        )
        for job_id, held, deps, array_id, index, max_running in rows
        if pending_ids is None or job_id in pending_ids
    ]


def evaluate(session: Session, job_gates: list[gates.JobGate]) -> gates.GateResult:
    """Read the dependencies' states and the arrays' active counts, then decide."""
    dep_ids = sorted({d.job_id for g in job_gates for d in g.depends_on})
    status: dict[str, str] = {}
    never_started: set[str] = set()
    for start in range(0, len(dep_ids), CHUNK):
        chunk = dep_ids[start : start + CHUNK]
        for job_id, job_status, started_at in session.execute(
            select(JobRow.id, JobRow.status, JobRow.started_at).where(JobRow.id.in_(chunk))
        ).all():
            status[job_id] = job_status
            if started_at is None:
                never_started.add(job_id)
    arrays = sorted({g.array_id for g in job_gates if g.array_id and g.array_max_running})
    active, quarantined = array_holders(session, arrays) if arrays else ({}, {})
    return gates.evaluate(job_gates, status, active, never_started, quarantined)


def array_holders(session: Session, arrays: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Per array id: how many of its tasks' attempts hold GPUs (what ``%N`` bounds), and how
    many of those are QUARANTINED (fenced on a lost node: the job may be PENDING again while
    the old attempt's processes may still run). An attempt is a job's token: a SCHEDULED or
    RUNNING task's current one, or any with an active reservation (RESERVED, CONFIRMED or
    QUARANTINED; a gang's members share one token and count once). Two indexed reads."""
    held: dict[str, set[tuple[str, int]]] = {}
    fenced: dict[str, set[tuple[str, int]]] = {}
    for array_id, job_id, token in session.execute(
        select(JobRow.array_id, JobRow.id, JobRow.fencing_epoch).where(
            JobRow.array_id.in_(arrays), JobRow.status.in_(ACTIVE)
        )
    ).all():
        held.setdefault(str(array_id), set()).add((job_id, int(token)))
    for array_id, job_id, token, res_status in session.execute(
        select(JobRow.array_id, ReservationRow.job_id, ReservationRow.token, ReservationRow.status)
        .join(JobRow, JobRow.id == ReservationRow.job_id)
        .where(
            JobRow.array_id.in_(arrays),
            ReservationRow.status.in_(sorted(RESERVATION_ACTIVE)),
        )
    ).all():
        held.setdefault(str(array_id), set()).add((job_id, int(token)))
        if res_status == ReservationStatus.QUARANTINED:
            fenced.setdefault(str(array_id), set()).add((job_id, int(token)))
    return (
        {a: len(attempts) for a, attempts in held.items()},
        {a: len(attempts) for a, attempts in fenced.items()},
    )


def gate_snapshot(
    session: Session, snap: ClusterSnapshot, pending_ids: Container[str] | None = None
) -> Gated:
    """Apply the gates to a snapshot read in the same database snapshot (``session``).

    ``pending_ids``: the ids of the snapshot's pending jobs when the caller has them at hand
    (``SnapshotCache.queued``), which saves building a set of 10,000 ids each pass."""
    ids: Container[str]
    if pending_ids is not None:
        ids = pending_ids
    elif snap.queues is not None:
        ids = {p.job_id for q in snap.queues.values() for p in q}
    else:
        ids = {p.job_id for p in snap.pending}
    job_gates = load_gates(session, ids)
    if not job_gates:
        return Gated(snap, gates.GateResult())
    result = evaluate(session, job_gates)
    return Gated(gates.filter_snapshot(snap, result), result)


def fail_dependents(session: Session, failed: Mapping[str, str], now: datetime) -> list[str]:
    """End each still-PENDING job of ``failed`` (job id -> reason) DEPENDENCY_FAILED, with its
    event; returns the ids ended (a job cancelled meanwhile is skipped)."""
    ended = []
    for job_id, why in sorted(failed.items()):
        try:
            transition(
                session,
                Machine.JOB,
                job_id,
                JobStatus.DEPENDENCY_FAILED,
                now=now,
                frm=[JobStatus.PENDING],
                values={"finished_at": now, "failure_reason": why, "pending_reason": None},
                message=why,
                job_id=job_id,
            )
        except StaleState:
            continue
        ended.append(job_id)
    return ended
