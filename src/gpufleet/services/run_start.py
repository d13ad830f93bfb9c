"""Delivering and confirming an attempt's start (seed DD2): the agent answered AssignJob
(:func:`mark_delivered`; rank 0 of a gang chose its MASTER_PORT, :func:`record_master_port`)
and confirmed the start (:func:`confirm_start`: RESERVED -> CONFIRMED, ASSIGNED -> RUNNING, the
job RUNNING once every member of a gang runs). Every write is guarded by ``run_id + token``; a
stale or unknown attempt is REJECTED and changes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import Table, bindparam, exists, func, literal_column, or_, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Forbidden
from gpufleet.domain.states import (
    RUN_TERMINAL,
    JobStatus,
    Machine,
    ReservationStatus,
    RunStatus,
    check_transition,
)
from gpufleet.services.run_stop import gang_members
from gpufleet.store.dialect import as_utc, now_sql, now_sql_for
from gpufleet.store.tables import JobRow, JobRunRow, ReservationRow
from gpufleet.store.transitions import record_event, record_transition, transition


class Confirm(enum.StrEnum):
    CONFIRMED = "CONFIRMED"
    REJECTED = "REJECTED"


@dataclass(frozen=True, slots=True)
class Confirmed:
    """What :func:`confirm_start` did, and the facts the time-to-start metric needs (read in
    the same statement, so that the metric costs no read of its own): ``queued_at`` and
    ``started_at`` UTC, ``gpu_count``, ``spec`` (the stored job spec) and ``start_phases``.
    Only ``result`` is set when REJECTED."""

    result: Confirm
    queued_at: datetime | None = None
    started_at: datetime | None = None
    start_phases: dict[str, Any] | None = None
    gpu_count: int = 0
    spec: dict[str, Any] | None = None


def confirm_assignment(
    session: Session,
    run_id: str,
    token: int,
    pid: int | None = None,
    *,
    node_id: str | None = None,
    start_phases: dict[str, Any] | None = None,
) -> Confirm:
    """The agent started ``run_id``: RESERVED -> CONFIRMED, ASSIGNED -> RUNNING, job -> RUNNING.
    Idempotent; a stale or unknown attempt is REJECTED (the agent then stops it). See
    :func:`confirm_start`, which this answers the result of."""
    return confirm_start(
        session, run_id, token, pid, node_id=node_id, start_phases=start_phases
    ).result


@cache
def _confirm_read(dialect: str) -> Any:
    """:func:`confirm_start`'s one read (run and job, the run locked, the database clock),
    built once per dialect (``p_run``)."""
    r, j = JobRunRow, JobRow
    return (
        select(
            r.id,
            r.job_id,
            r.node_id,
            r.token,
            r.status,
            r.gang_size,
            r.started_at,
            r.assigned_at,
            r.start_phases,
            j.fencing_epoch,
            j.current_run_id,
            j.status.label("job_status"),
            j.queued_at,
            j.gpu_count,
            j.spec,
            now_sql_for(dialect).label("clock"),
        )
        .join(j, j.id == r.job_id)
        .where(r.id == bindparam("p_run", type_=r.id.type))
        .with_for_update(of=r)
    )


@cache
def _confirm_first(dialect: str, pid: bool, phases: bool, node: bool) -> Any:
    """:func:`confirm_start`'s first statement for a first confirmation, built once per
    (dialect, pid given, start phases given, node checked) with ``p_run``, ``p_token`` (and
    ``p_pid``, ``p_phases``, ``p_node``): the run ASSIGNED -> RUNNING only if it is still
    ASSIGNED under ``token``, on the caller's node, and the job's current attempt at that
    token (the checks the read makes, in its WHERE clause), RETURNING what the rest of the
    confirmation and the time-to-start metric need of the run and its job, and the database
    clock (as the new ``started_at``): the read and the run's UPDATE in one statement."""
    # the edge is the transition table's (IllegalTransition here, before anything is written)
    check_transition(Machine.RUN, RunStatus.ASSIGNED, RunStatus.RUNNING)
    r, j = JobRunRow.__table__.c, JobRow.__table__.c
    now = now_sql_for(dialect, stable=True)  # one value for started_at and assigned_at
    sets: dict[str, Any] = {
        "status": RunStatus.RUNNING,
        "started_at": now,
        # a confirmation is also the delivery (mark_delivered) when it came first
        "assigned_at": func.coalesce(r.assigned_at, now),
    }
    conds = [
        r.id == bindparam("p_run", type_=r.id.type),
        r.status == RunStatus.ASSIGNED,
        r.token == bindparam("p_token", type_=r.token.type),
        # is_current: the job's fencing epoch is this token and the run its current attempt
        # (any member of a gang attempt)
        exists()
        .where(
            j.id == r.job_id,
            j.fencing_epoch == r.token,
            or_(j.current_run_id == r.id, r.gang_size > 1),
        )
        .correlate(JobRunRow.__table__),
    ]
    if pid:
        sets["pid"] = bindparam("p_pid", type_=r.pid.type)
    if phases:
        sets["start_phases"] = bindparam("p_phases", type_=r.start_phases.type)
        conds.append(r.start_phases.is_(None))  # else the read decides (no second event)
    if node:
        conds.append(r.node_id == bindparam("p_node", type_=r.node_id.type))

    def of_job(col: Any) -> Any:
        # the run's column named with its table: SQLite's compiler leaves the names of a
        # RETURNING clause unqualified, and an unqualified job_id inside the subquery would
        # mean a column of jobs if it ever had one
        return (
            select(col)
            .where(j.id == literal_column("job_runs.job_id"))
            .scalar_subquery()
            .label(col.name if col is not j.status else "job_status")
        )

    return (
        update(cast(Table, JobRunRow.__table__))
        .where(*conds)
        .values(sets)
        .returning(
            r.job_id,
            r.node_id,
            r.gang_size,
            r.started_at,
            of_job(j.status),
            of_job(j.queued_at),
            of_job(j.gpu_count),
            of_job(j.spec),
        )
    )


def confirm_start(
    session: Session,
    run_id: str,
    token: int,
    pid: int | None = None,
    *,
    node_id: str | None = None,
    start_phases: dict[str, Any] | None = None,
) -> Confirmed:
    """The agent started ``run_id``: RESERVED -> CONFIRMED, ASSIGNED -> RUNNING, job -> RUNNING.
    Idempotent; a stale or unknown attempt is REJECTED (the agent then stops it).

    ``start_phases``: how the node started it (``runtime``, ``image`` warm/cold, ``pull_s``,
    ``create_s``, ``start_s`` in seconds); stored on the attempt and in the event message.

    Statements: a first confirmation of the current attempt (the usual one) is the run's
    guarded UPDATE ASSIGNED -> RUNNING with every check in its WHERE clause, RETURNING what
    the rest needs (:func:`_confirm_first`), then one guarded UPDATE per other row that moves
    (reservation, job) and the batched event INSERT. When that UPDATE matches nothing (an
    unknown, stale or finished attempt, another node's, a repeated confirmation), one SELECT
    (run and job, the run locked, the database clock) decides as before: REJECTED, Forbidden,
    or a repeated confirmation (pid, start phases, the reservation and the job moved if they
    are not yet).

    Raises:
        Forbidden: ``node_id`` (the caller's certified node, if given) is not the node the
            attempt was placed on; nothing changes.
    """
    dialect = session.get_bind().dialect.name
    params: dict[str, Any] = {"p_run": run_id, "p_token": token}
    if pid:
        params["p_pid"] = pid
    if start_phases:
        params["p_phases"] = start_phases
    if node_id is not None:
        params["p_node"] = node_id
    first = session.execute(
        _confirm_first(dialect, bool(pid), bool(start_phases), node_id is not None), params
    ).first()
    if first is not None:
        now = first.started_at
        if start_phases:
            _record_start_phases(session, now, first.job_id, run_id, first.node_id, start_phases)
        record_transition(
            session,
            Machine.RUN,
            run_id,
            RunStatus.ASSIGNED,
            RunStatus.RUNNING,
            now=now,
            message="agent confirmed the start",
            job_id=first.job_id,
            run_id=run_id,
            node_id=first.node_id,
        )
        _confirm_the_rest(
            session,
            run_id,
            token,
            first.job_id,
            first.node_id,
            first.gang_size,
            first.job_status,
            now,
        )
        return Confirmed(
            Confirm.CONFIRMED,
            queued_at=first.queued_at,
            started_at=now,
            start_phases=start_phases or None,
            gpu_count=first.gpu_count,
            spec=first.spec,
        )
    found = session.execute(
        _confirm_read(session.get_bind().dialect.name), {"p_run": run_id}
    ).first()
    if found is not None and node_id is not None and found.node_id != node_id:
        raise Forbidden(f"run {run_id} is not placed on node {node_id!r}", field="run_id")
    if (
        found is None
        or found.token != token
        or found.fencing_epoch != found.token
        or not (found.current_run_id == found.id or found.gang_size > 1)
        or found.status in RUN_TERMINAL
    ):  # not the job's current attempt (is_current), or over
        return Confirmed(Confirm.REJECTED)
    now = as_utc(found.clock)
    job_id, run_node = found.job_id, found.node_id
    started_at = found.started_at
    values: dict[str, Any] = {}
    if pid:
        values["pid"] = pid
    phases = found.start_phases
    if start_phases and not found.start_phases:
        values["start_phases"] = phases = start_phases
        _record_start_phases(session, now, job_id, run_id, run_node, start_phases)
    if found.status == RunStatus.ASSIGNED:
        started_at = now
        transition(
            session,
            Machine.RUN,
            run_id,
            RunStatus.RUNNING,
            now=now,
            frm=[RunStatus.ASSIGNED],
            guard={"token": token},
            # a confirmation is also the delivery (mark_delivered) when it came first
            values={"started_at": now, **values}
            if found.assigned_at is not None
            else {"started_at": now, "assigned_at": now, **values},
            job_id=job_id,
            run_id=run_id,
            node_id=run_node,
            message="agent confirmed the start",
        )
    elif values:
        session.execute(update(JobRunRow).where(JobRunRow.id == run_id).values(**values))
    _confirm_the_rest(
        session, run_id, token, job_id, run_node, found.gang_size, found.job_status, now
    )
    return Confirmed(
        Confirm.CONFIRMED,
        queued_at=found.queued_at,
        started_at=started_at,
        start_phases=phases,
        gpu_count=found.gpu_count,
        spec=found.spec,
    )


def _record_start_phases(
    session: Session,
    now: datetime,
    job_id: str,
    run_id: str,
    node_id: str,
    start_phases: dict[str, Any],
) -> None:
    """The attempt's ``start_phases`` event (how the node started it), once per attempt."""
    record_event(
        session,
        "start_phases",
        now=now,
        message="started on the node" + describe_phases(start_phases),
        job_id=job_id,
        run_id=run_id,
        node_id=node_id,
        details=start_phases,
    )


def _confirm_the_rest(
    session: Session,
    run_id: str,
    token: int,
    job_id: str,
    run_node: str,
    gang_size: int,
    job_status: str,
    now: datetime,
) -> None:
    """A confirmation after its run moved: the reservation RESERVED -> CONFIRMED (if still
    RESERVED under ``token``) and the job SCHEDULED -> RUNNING (once every member of a gang
    runs), each a guarded UPDATE, with their events."""
    res_c = ReservationRow.__table__.c
    confirmed = session.execute(
        update(ReservationRow)
        .where(
            res_c.run_id == run_id,
            res_c.status == ReservationStatus.RESERVED,
            res_c.token == token,
        )
        .values(status=ReservationStatus.CONFIRMED)
        .returning(res_c.id)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if confirmed is not None:
        record_transition(
            session,
            Machine.RESERVATION,
            confirmed,
            ReservationStatus.RESERVED,
            ReservationStatus.CONFIRMED,
            now=now,
            job_id=job_id,
            run_id=run_id,
            node_id=run_node,
        )
    if job_status == JobStatus.SCHEDULED and _all_members_running(
        session, job_id, token, gang_size
    ):
        transition(
            session,
            Machine.JOB,
            job_id,
            JobStatus.RUNNING,
            now=now,
            frm=[JobStatus.SCHEDULED],
            guard={"fencing_epoch": token},
            values={"started_at": now},
            job_id=job_id,
            run_id=run_id,
        )


def _all_members_running(session: Session, job_id: str, token: int, gang_size: int) -> bool:
    """A gang attempt is RUNNING only once every member confirmed its start."""
    if gang_size <= 1:
        return True
    session.flush()
    running = session.execute(
        select(func.count())
        .select_from(JobRunRow)
        .where(
            JobRunRow.job_id == job_id,
            JobRunRow.token == token,
            JobRunRow.started_at.is_not(None),
        )
    ).scalar_one()
    return int(running) >= gang_size


def describe_phases(p: dict[str, Any] | None) -> str:
    """`` (container, cold image: pull 2.91 s, create 0.12 s, start 0.20 s)`` or ``""``."""
    if not p:
        return ""
    if p.get("runtime") == "container":
        pull, create, start = (float(p.get(k, 0)) for k in ("pull_s", "create_s", "start_s"))
        return (
            f" (container, {p.get('image') or '?'} image: pull {pull:.2f} s,"
            f" create {create:.2f} s, start {start:.2f} s)"
        )
    return f" (process, start {float(p.get('start_s', 0)):.3f} s)"


def record_master_port(session: Session, run_id: str, port: int) -> list[str]:
    """Rank 0's agent chose ``port`` for MASTER_PORT: keep it (the first answer wins; a
    re-sent AssignJob answers the same port) and return the other members still to assign
    (ASSIGNED), in rank order."""
    run = session.get(JobRunRow, run_id)
    if run is None or run.rank != 0 or run.gang_size <= 1:
        return []
    if run.master_port is None:
        session.execute(
            update(JobRunRow)
            .where(JobRunRow.id == run_id, JobRunRow.master_port.is_(None))
            .values(master_port=port)
        )
    return [
        m.id
        for m in gang_members(session, run.job_id, run.token)
        if m.rank > 0 and m.status == RunStatus.ASSIGNED
    ]


def mark_delivered(session: Session, run_id: str) -> None:
    """The agent answered AssignJob (started or already running): record the delivery."""
    session.execute(
        update(JobRunRow).where(JobRunRow.id == run_id).values(assigned_at=now_sql(session))
    )
