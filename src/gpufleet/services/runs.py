"""Attempt lifecycle on the control plane: confirm, stop request, and completion (seed DD2,
DD5, DD8). Every write is guarded by ``run_id + token``; a stale token changes nothing about
the job, and capacity is returned only on the agent's word that the processes are gone.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any, cast

from sqlalchemy import Table, bindparam, exists, func, literal_column, or_, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Forbidden
from gpufleet.domain.manifest import MANIFEST_NAME, Manifest, file_problem
from gpufleet.domain.states import (
    RESERVATION_ACTIVE,
    RUN_TERMINAL,
    JobStatus,
    Machine,
    ReservationStatus,
    RunStatus,
    check_transition,
)
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.usage import UsageLedger
from gpufleet.store import accounting, allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import as_utc, db_now, now_sql, now_sql_for
from gpufleet.store.leader import assert_leader
from gpufleet.store.tables import ApiTokenRow, JobRow, JobRunRow, NodeRow, ReservationRow, TeamRow
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


def is_current(job: JobRow, run: JobRunRow) -> bool:
    """``run`` is (a member of) the job's authoritative attempt: it carries the job's token,
    and it is ``current_run_id`` or a member of the same gang attempt (rank 0 is
    ``current_run_id``; every member shares the token, which no other attempt ever has)."""
    return job.fencing_epoch == run.token and (
        job.current_run_id == run.id or (run.gang_size > 1 and run.job_id == job.id)
    )


def gang_cause(session: Session, run: JobRunRow, job_to: JobStatus) -> dict[str, str]:
    """``{"gang_outcome": job_to}`` when ``run`` is the first member of its gang attempt to end
    unsuccessfully (the attempt's cause: its decided job status is kept on it for the gang's
    end, ``finish_gang_if_done``), else ``{}``. Used by completion and by fencing alike."""
    others = gang_members(session, run.job_id, run.token)
    if any(m.gang_outcome is not None and m.id != run.id for m in others):
        return {}
    return {"gang_outcome": str(job_to)}


def gang_members(session: Session, job_id: str, token: int) -> list[JobRunRow]:
    """Every member of the gang attempt of ``job_id`` with ``token``, in rank order."""
    return list(
        session.scalars(
            select(JobRunRow)
            .where(JobRunRow.job_id == job_id, JobRunRow.token == token)
            .order_by(JobRunRow.rank)
        )
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


GANG_STOP = "gang"
"""``stop_reason`` of a member stopped because another member of its gang attempt ended
unsuccessfully (or its node was fenced): the whole attempt stops as one unit."""


def stop_gang(
    session: Session, job_id: str, token: int, *, cause_run_id: str, message: str
) -> list[str]:
    """Mark every other still-starting or running member of the gang attempt PREEMPTING
    (reason ``gang``): durable, so the stop driver sends their StopRun (SIGTERM, grace,
    SIGKILL) until each agent reports the processes gone. Returns the run ids marked."""
    marked = []
    for member in gang_members(session, job_id, token):
        if member.id == cause_run_id or member.status not in (
            RunStatus.ASSIGNED,
            RunStatus.RUNNING,
        ):
            continue
        if request_stop(session, member.id, token, GANG_STOP, message=message):
            marked.append(member.id)
    return marked


def request_stop(
    session: Session,
    run_id: str,
    token: int,
    reason: str,
    *,
    message: str,
    for_job_id: str | None = None,
) -> list[str]:
    """Durably mark an active attempt PREEMPTING (reason: cancel | preempt | timeout |
    requeue | gang). GPUs stay reserved until the agent reports the processes gone.
    ``for_job_id``: the preemptor the GPUs are freed for.

    A gang attempt stops as one unit: stopping one member (for any reason but ``gang``, which
    :func:`stop_gang` uses for the members of a failed attempt) marks every other still-live
    member with the same reason. Returns the run ids marked, ``run_id``'s first; empty if it
    was already stopping or no longer active."""
    now = db_now(session)
    run = session.get(JobRunRow, run_id)
    if run is None or run.status not in (RunStatus.ASSIGNED, RunStatus.RUNNING):
        return []
    targets = [run]
    if run.gang_size > 1 and reason != GANG_STOP:
        targets += [
            m
            for m in gang_members(session, run.job_id, token)
            if m.id != run.id and m.status in (RunStatus.ASSIGNED, RunStatus.RUNNING)
        ]
    for target in targets:
        transition(
            session,
            Machine.RUN,
            target.id,
            RunStatus.PREEMPTING,
            now=now,
            frm=[target.status],
            guard={"token": token},
            values={
                "stop_reason": reason,
                "stop_requested_at": now,
                "preempted_for_job_id": for_job_id,
            },
            job_id=target.job_id,
            run_id=target.id,
            node_id=target.node_id,
            message=message if target is run else f"{message} (with its gang)",
        )
    return [t.id for t in targets]


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


class Outcome(enum.StrEnum):
    EXITED = "EXITED"
    STOPPED = "STOPPED"
    NEVER_STARTED = "NEVER_STARTED"


class CompletionResult(enum.StrEnum):
    ACCEPTED = "ACCEPTED"
    STALE = "STALE"
    REJECTED = "REJECTED"


@dataclass(frozen=True, slots=True)
class Report:
    node_id: str
    run_id: str
    token: int
    outcome: Outcome
    exit_code: int
    manifest_uri: str
    message: str = ""
    node_fault: bool = False
    """NEVER_STARTED because of the node: charged to the node, not the job's retries."""
    reason: str = ""  # machine-readable cause from the agent: "" or OOM_KILLED
    node_refused: bool = False
    """With ``node_fault``: the agent refused the assignment on a failed health check."""


OOM_KILLED = "OOM_KILLED"


NODE_FAULTS_TO_CORDON = 3
NODE_FAULT_WINDOW_S = 600.0
"""A node charged with this many start failures within this window is cordoned."""


@dataclass(frozen=True, slots=True)
class Verified:
    ok: bool
    problem: str = ""
    manifest: Manifest | None = None


def verify_manifest(store: ObjectStore, job_id: str, report: Report) -> Verified:
    """Every listed object exists with its size and sha256, the manifest is where the attempt's
    manifest must be, and it carries the reported job, run and token (seed DD8). Each key must
    be the normalised ``{attempt prefix}/{kind folder}/{path}`` (no ``..``, absolute path or
    backslash: ``domain.manifest.file_problem``), so nothing outside the attempt is vouched
    for. Object-store I/O: call outside any transaction."""
    if not report.manifest_uri:
        return Verified(False, "no manifest")
    expected_key = f"{attempt_prefix(job_id, report.run_id)}/{MANIFEST_NAME}"
    try:
        key = store.key_of(report.manifest_uri)
        if key != expected_key:
            return Verified(False, f"manifest at {key}, expected {expected_key}")
        manifest = Manifest.from_json(store.get_bytes(key))
    except (ValueError, FileNotFoundError, OSError) as exc:
        return Verified(False, f"manifest unreadable: {exc}")
    if (
        manifest.job_id != job_id
        or manifest.run_id != report.run_id
        or manifest.token != report.token
    ):
        return Verified(False, "manifest job_id/run_id/token differ from the report")
    prefix = attempt_prefix(job_id, report.run_id)
    for f in manifest.files:
        problem = file_problem(f, prefix)
        if problem is not None:
            return Verified(False, problem)
        try:
            if store.size(f.key) != f.size or store.sha256(f.key) != f.sha256:
                return Verified(False, f"{f.key}: size or sha256 mismatch")
        except (FileNotFoundError, OSError):
            return Verified(False, f"{f.key} is missing")
    return Verified(True, manifest=manifest)


@cache
def _completion_read(dialect: str) -> Any:
    """:func:`complete_run`'s one read, built once per dialect (``p_run``): run and job
    locked, the database clock, and what the end needs of the node, the submitting token, the
    team (read unlocked: charged optimistically) and the active reservation."""
    res_c = ReservationRow.__table__.c
    return (
        select(
            JobRunRow,
            JobRow,
            now_sql_for(dialect).label("clock"),
            NodeRow.gpu_type,
            ApiTokenRow.name,
            TeamRow.usage_gpu_s,
            TeamRow.usage_as_of,
            res_c.id.label("res_id"),
            res_c.status.label("res_status"),
            res_c.gpu_count.label("res_gpus"),
            res_c.node_id.label("res_node"),
        )
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .outerjoin(NodeRow, NodeRow.id == JobRunRow.node_id)
        .outerjoin(ApiTokenRow, ApiTokenRow.id == JobRow.submitted_by)
        .outerjoin(TeamRow, TeamRow.id == JobRow.team_id)
        .outerjoin(
            ReservationRow,
            (res_c.run_id == JobRunRow.id) & res_c.status.in_(sorted(RESERVATION_ACTIVE)),
        )
        .where(JobRunRow.id == bindparam("p_run", type_=JobRunRow.id.type))
        .with_for_update(of=[JobRunRow, JobRow])
    )


def complete_run(
    db: Database,
    store: ObjectStore,
    report: Report,
    *,
    leader: tuple[str, int] | None = None,
    inferred: bool = False,
    max_node_failures: int = 3,
    retry_backoff: tuple[float, float] = (10.0, 300.0),
) -> tuple[CompletionResult, str]:
    """Commit one attempt's end, once. Returns (result, message).

    Args:
        leader: ``(holder, epoch)`` of the controller writing a conclusion of its own (not an
            agent's report): checked against the lease inside the transaction (NotLeader).
        inferred: the controller concluded NEVER_STARTED from an agent's answer to AssignJob
            or StopRun. Such a conclusion never overrides a confirmed attempt (one the agent
            confirmed as started): it answers STALE and changes nothing.

    - current attempt: run terminal, job terminal or back to PENDING (retry / preemption),
      reservation released, team charged the GPU-time really used, all in one transaction;
    - a repeated report of an already-committed run: ACCEPTED again, nothing changes;
    - a stale attempt (not the job's current one): STALE, the job is untouched; its own
      reservation is still released, because the agent says its processes are gone.

    Raises:
        Forbidden: ``report.node_id`` is not the node the attempt was placed on (a node
            reports only for its own runs); nothing changes.
    """
    # the manifest is verified before the transaction (object-store I/O), against the job
    # its key names; the transaction checks that this is the run's job (no read before it)
    claimed = _claimed_job_id(store, report)
    verified = Verified(True)
    if report.outcome != Outcome.NEVER_STARTED and claimed is not None:
        verified = verify_manifest(store, claimed, report)

    def tx(session: Session) -> tuple[CompletionResult, str]:
        # one statement: run and job locked, the database clock, and what the end needs of
        # the node, the submitting token, the team (read unlocked: charged optimistically)
        # and the active reservation
        row = session.execute(
            _completion_read(session.get_bind().dialect.name), {"p_run": report.run_id}
        ).first()
        if row is None:
            return CompletionResult.STALE, "unknown run"
        run, job = row[0], row[1]
        if run.node_id != report.node_id:
            raise Forbidden(
                f"run {report.run_id} is not placed on node {report.node_id!r}", field="run_id"
            )
        if run.status == RunStatus.FENCED and not inferred:
            # the agent's word that a fenced run's processes are gone: GPUs come back
            gpus = allocate.release(
                session,
                run_id=run.id,
                now=None,
                message=f"agent reported the fenced run {report.outcome.lower()}",
                only_quarantined=True,
            )
            return CompletionResult.STALE, f"the attempt was fenced; {gpus} GPU(s) released"
        checked = verified
        if report.outcome != Outcome.NEVER_STARTED and claimed != job.id:
            # the manifest is not at this run's place: answered without object-store I/O
            checked = verify_manifest(store, job.id, report)
        now = as_utc(row.clock)
        usage = (
            accounting.AttemptFacts(
                job.id,
                run.attempt,
                run.node_id,
                run.gpu_ids,
                run.created_at,
                job.team_id,
                job.submitted_by,
                row.gpu_type,
                row.name,
            )
            if row.gpu_type is not None
            else None
        )
        reservation = (
            allocate.ActiveReservation(
                row.res_id, job.id, row.res_node, row.res_gpus, row.res_status
            )
            if row.res_id is not None
            else None
        )
        team_usage = (row.usage_gpu_s, row.usage_as_of) if row.usage_gpu_s is not None else None
        if run.status in RUN_TERMINAL:
            return CompletionResult.ACCEPTED, f"already committed as {run.status}"
        if run.token != report.token:
            return CompletionResult.STALE, f"token {report.token} is not this run's ({run.token})"
        if leader is not None:
            assert_leader(session, leader[0], leader[1], now)
        if inferred and (run.started_at is not None or run.status == RunStatus.RUNNING):
            return CompletionResult.STALE, "the attempt was confirmed running; not overridden"
        current = is_current(job, run)
        run_to, job_to, why = _decide(session, run, job, report, checked, current)
        gang_stopped = (
            run.gang_size > 1 and run.stop_reason == GANG_STOP and run_to != RunStatus.SUCCEEDED
        )
        if gang_stopped:  # not the cause: the attempt's outcome is its cause's
            job_to, why = None, f"stopped with its gang ({run.message or 'a member ended'})"
        blame = "job" if run_to == RunStatus.FAILED and not gang_stopped else None
        node_fault = report.node_fault and report.outcome == Outcome.NEVER_STARTED
        if node_fault and run_to == RunStatus.FAILED:
            blame = "node"
            if current and job_to in (JobStatus.PENDING, JobStatus.FAILED):
                job_to, why = _after_node_fault(session, job, why, max_node_failures)
        values = {
            # an assignment refused on a failed health check (nothing started; the node is
            # UNHEALTHY until its check passes) is the node's, but neither a start failure
            # towards the auto-cordon nor a node loss of the job: one full-disk episode must
            # not turn into a cordon only an operator lifts
            "charged_to": "refused"
            if blame == "node" and report.node_refused
            else ("system" if (inferred or gang_stopped) and blame != "node" else blame),
            "finished_at": now,
            "exit_code": report.exit_code if report.outcome != Outcome.NEVER_STARTED else None,
            "manifest_uri": report.manifest_uri or None,
            "message": why,
        }
        if checked.manifest is not None:
            values["checkpoint_prefix"] = checked.manifest.checkpoint_prefix()
        gang = run.gang_size > 1 and current
        if gang and run_to != RunStatus.SUCCEEDED and job_to is not None:
            values.update(gang_cause(session, run, job_to))
        transition(
            session,
            Machine.RUN,
            run.id,
            run_to,
            now=now,
            frm=[run.status],
            guard={"token": report.token},
            values=values,
            job_id=job.id,
            run_id=run.id,
            node_id=run.node_id,
            message=f"rank {run.rank}: {why}" if gang else why,
            usage=usage,
        )
        if gang:
            return _complete_gang_member(
                session, run, job, run_to, why, values, now, retry_backoff
            )
        gpus = allocate.release(
            session,
            run_id=run.id,
            now=now,
            message=f"agent reported {report.outcome.lower()}",
            known=reservation,
        )
        charge_usage(
            session,
            job.team_id,
            gpus,
            reserved_at=run.created_at,
            released_at=now,
            known=team_usage,
        )
        if not current:
            return CompletionResult.STALE, "not the job's current attempt; job unchanged"
        if job_to is not None:
            job_values: dict[str, object] = {}
            if job_to == JobStatus.PENDING:
                after = (
                    f"exit code {report.exit_code}"
                    if report.outcome == Outcome.EXITED and checked.ok
                    else why
                )
                job_values = _requeue_values(
                    session,
                    job.id,
                    now,
                    keeps_place=run_to == RunStatus.PREEMPTED or blame == "node",
                    backs_off=blame == "job",
                    after=after,
                    retry_backoff=retry_backoff,
                )
            else:
                job_values = {
                    "finished_at": now,
                    "failure_reason": None if job_to == JobStatus.SUCCEEDED else why,
                }
                if job_to == JobStatus.SUCCEEDED:
                    job_values["result_uri"] = report.manifest_uri
            transition(
                session,
                Machine.JOB,
                job.id,
                job_to,
                now=now,
                frm=[job.status],
                guard={"fencing_epoch": report.token},
                values=job_values,
                job_id=job.id,
                run_id=run.id,
                message=why,
            )
        if blame == "node":
            _cordon_if_failing(session, run.node_id, now)
        if not checked.ok and report.outcome == Outcome.EXITED and report.exit_code == 0:
            return CompletionResult.REJECTED, why
        return CompletionResult.ACCEPTED, why

    return db.run_write(tx)


def _claimed_job_id(store: ObjectStore, report: Report) -> str | None:
    """The job id in the key of the report's manifest (``jobs/{job}/attempts/{run}/...``,
    ``objectstore.attempt_prefix``), or None when it has no such key."""
    if not report.manifest_uri:
        return None
    try:
        parts = store.key_of(report.manifest_uri).split("/")
    except ValueError:
        return None
    shaped = len(parts) == 5 and parts[0] == "jobs" and parts[2] == "attempts"
    if shaped and parts[3] == report.run_id and parts[4] == MANIFEST_NAME:
        return parts[1]
    return None


def _decide(
    session: Session,
    run: JobRunRow,
    job: JobRow,
    report: Report,
    verified: Verified,
    current: bool,
) -> tuple[RunStatus, JobStatus | None, str]:
    """(run's terminal status, job's next status or None, a sentence)."""
    stopping = run.status == RunStatus.PREEMPTING
    if report.outcome == Outcome.EXITED and report.exit_code == 0:
        if verified.ok:
            return RunStatus.SUCCEEDED, JobStatus.SUCCEEDED, "exited 0; manifest verified"
        why = f"exited 0 but the manifest failed verification: {verified.problem}"
        return RunStatus.FAILED, _failed_next(session, job, current), why
    if stopping and run.stop_reason == "cancel":
        return (
            RunStatus.CANCELLED,
            JobStatus.CANCELLED,
            "cancelled by user; processes verified gone",
        )
    if stopping and run.stop_reason == "preempt":
        by = f" for {run.preempted_for_job_id}" if run.preempted_for_job_id else ""
        if job.cancel_requested:
            return RunStatus.PREEMPTED, JobStatus.CANCELLED, f"preempted{by}, then cancelled"
        return RunStatus.PREEMPTED, JobStatus.PENDING, f"preempted{by}; requeued as a new attempt"
    if stopping and run.stop_reason == "requeue":  # a user's requeue (services.jobctl)
        if job.cancel_requested:
            return RunStatus.PREEMPTED, JobStatus.CANCELLED, "requeue requested, then cancelled"
        return RunStatus.PREEMPTED, JobStatus.PENDING, "requeued by user as a new attempt"
    if stopping and run.stop_reason == "timeout":
        return RunStatus.FAILED, JobStatus.FAILED, "TIMEOUT: ran past max_runtime_s"
    if report.reason == OOM_KILLED and report.outcome != Outcome.NEVER_STARTED:
        # Not retried: a new attempt gets the same memory_mb and would be killed again.
        why = f"OOM_KILLED: {report.message or 'exceeded memory_mb'}".replace(
            "OOM_KILLED: OOM_KILLED: ", "OOM_KILLED: "
        )
        return RunStatus.FAILED, (JobStatus.FAILED if current else None), why
    if report.outcome == Outcome.NEVER_STARTED:
        why = f"never started: {report.message or 'the agent has no record of it'}"
    elif report.outcome == Outcome.STOPPED:
        why = f"stopped by the agent: {report.message or 'no longer authoritative'}"
    else:
        why = f"exited with code {report.exit_code}"
    return RunStatus.FAILED, _failed_next(session, job, current), why


def _requeue_values(
    session: Session,
    job_id: str,
    now: datetime,
    *,
    keeps_place: bool,
    backs_off: bool,
    after: str,
    retry_backoff: tuple[float, float],
) -> dict[str, object]:
    """Job-row values for an attempt that ends with the job back in PENDING (single node and
    gang alike). A retry after a failure goes to the back of its class (``queued_at``); a
    preempted job, or one the node failed, keeps its place (``keeps_place``: it did nothing
    wrong; the simulator does the same). The job's own failure (``backs_off``) waits
    ``retry_delay_s`` before the next attempt, and its pending reason says so."""
    values: dict[str, object] = {"pending_reason": None}
    if not keeps_place:
        values["queued_at"] = now
    if backs_off:
        delay = retry_delay_s(session, job_id, *retry_backoff)
        retry_at = now + timedelta(seconds=delay)
        values["retry_after"] = retry_at
        values["pending_reason"] = {
            "code": "retry_backoff",
            "message": f"retrying in {delay:.0f} s after {after}",
            "details": {"after": after, "retry_at": iso_utc(retry_at)},
            "position": None,
            "estimated_start_at": None,
        }
    return values


def retry_delay_s(session: Session, job_id: str, base_s: float, cap_s: float) -> float:
    """Exponential backoff with jitter before the next attempt of a job that failed ``n``
    times (its own failures, this one included): ``min(cap, base * 2^(n-1))`` times a
    uniform jitter in [0.5, 1] (so a burst of failing jobs does not retry in lockstep)."""
    session.flush()
    failures = session.execute(
        # distinct attempts: two members of one gang attempt failing use one retry
        select(func.count(func.distinct(JobRunRow.attempt)))
        .select_from(JobRunRow)
        .where(
            JobRunRow.job_id == job_id,
            JobRunRow.status == RunStatus.FAILED,
            or_(JobRunRow.charged_to.is_(None), JobRunRow.charged_to == "job"),
        )
    ).scalar_one()
    n = max(1, int(failures))
    return float(min(cap_s, base_s * 2.0 ** (n - 1)) * random.uniform(0.5, 1.0))


def iso_utc(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _after_node_fault(
    session: Session, job: JobRow, why: str, max_node_failures: int
) -> tuple[JobStatus, str]:
    """A start failure the node caused: the job goes back to PENDING (no user retry used)
    while it has lost at most ``max_node_failures`` attempts to nodes."""
    if job.cancel_requested:
        return JobStatus.CANCELLED, why
    session.flush()
    lost = session.execute(
        select(func.count())
        .select_from(JobRunRow)
        .where(JobRunRow.job_id == job.id, JobRunRow.charged_to == "node")
    ).scalar_one()
    if lost < max_node_failures:  # this attempt is not flushed as charged yet
        return JobStatus.PENDING, f"{why} (the node's fault: re-placed, no retry used)"
    return JobStatus.FAILED, f"{why} (lost {lost + 1} attempts to failed nodes)"


def _cordon_if_failing(session: Session, node_id: str, now: datetime) -> None:
    """Cordon a node charged with NODE_FAULTS_TO_CORDON start failures in the window."""
    from datetime import timedelta

    from gpufleet.domain.states import NodeStatus
    from gpufleet.store.tables import NodeRow

    session.flush()
    recent = session.execute(
        select(func.count())
        .select_from(JobRunRow)
        .where(
            JobRunRow.node_id == node_id,
            JobRunRow.charged_to == "node",
            JobRunRow.status == RunStatus.FAILED,
            JobRunRow.finished_at >= now - timedelta(seconds=NODE_FAULT_WINDOW_S),
        )
    ).scalar_one()
    node = session.get(NodeRow, node_id, with_for_update=True)
    if recent < NODE_FAULTS_TO_CORDON or node is None:
        return
    if node.status not in (NodeStatus.HEALTHY, NodeStatus.UNHEALTHY, NodeStatus.SUSPECT):
        return
    reason = (
        f"auto-cordoned: {recent} start failures caused by the node in the last"
        f" {NODE_FAULT_WINDOW_S:.0f} s"
    )
    transition(
        session,
        Machine.NODE,
        node_id,
        NodeStatus.CORDONED,
        now=now,
        frm=[node.status],
        values={"status_reason": reason},
        node_id=node_id,
        message=reason,
    )


def _failed_next(session: Session, job: JobRow, current: bool) -> JobStatus | None:
    """A failed attempt: back to PENDING if retries are left (and no cancel), else FAILED."""
    if not current:
        return None
    if job.cancel_requested:
        return JobStatus.CANCELLED
    failed_before = session.execute(
        select(func.count(func.distinct(JobRunRow.attempt)))
        .select_from(JobRunRow)
        .where(
            JobRunRow.job_id == job.id,
            JobRunRow.status == RunStatus.FAILED,
            # failures the node or the system caused do not consume the job's retries
            or_(JobRunRow.charged_to.is_(None), JobRunRow.charged_to == "job"),
        )
    ).scalar_one()
    max_retries = int(job.spec.get("max_retries") or 0)
    return JobStatus.PENDING if failed_before < max_retries else JobStatus.FAILED


def charge_usage(
    session: Session,
    team_id: str,
    gpus: int,
    *,
    reserved_at: datetime,
    released_at: datetime,
    half_life_s: float = PolicyConfig().usage_half_life_s,
    known: tuple[float, datetime | None] | None = None,
) -> None:
    """Charge the GPU-time one attempt held, from reservation to release, whatever its
    outcome (succeeded, failed, preempted, cancelled), decayed as ``policy.usage`` defines; so
    a retry or a preemption costs its team exactly the GPU-time it really held.

    ``known``: the team's ``(usage_gpu_s, usage_as_of)`` as the caller read them (unlocked)
    in this transaction: one UPDATE guarded by those values (optimistic); if another charge
    changed them meanwhile, the row is locked and read as without ``known``."""
    if gpus <= 0:
        return
    if known is not None:
        value, as_of_at = _charged(known[0], known[1], gpus, reserved_at, released_at, half_life_s)
        t = TeamRow.__table__.c
        same_as_of = t.usage_as_of.is_(None) if known[1] is None else t.usage_as_of == known[1]
        hit = session.execute(
            update(TeamRow)
            .where(t.id == team_id, t.usage_gpu_s == known[0], same_as_of)
            .values(usage_gpu_s=value, usage_as_of=as_of_at)
            .execution_options(synchronize_session=False)
        )
        if hit.rowcount == 1:  # type: ignore[attr-defined]
            return
    team = session.get(TeamRow, team_id, with_for_update=True)
    if team is None:
        return
    team.usage_gpu_s, team.usage_as_of = _charged(
        team.usage_gpu_s, team.usage_as_of, gpus, reserved_at, released_at, half_life_s
    )


def _charged(
    usage_gpu_s: float,
    usage_as_of: datetime | None,
    gpus: int,
    reserved_at: datetime,
    released_at: datetime,
    half_life_s: float,
) -> tuple[float, datetime]:
    """A team's (usage_gpu_s, usage_as_of) after charging one attempt (``policy.usage``)."""
    as_of = (usage_as_of or released_at).timestamp()
    ledger = UsageLedger(usage_gpu_s, min(as_of, released_at.timestamp()), half_life_s)
    ledger.charge_attempt(gpus, reserved_at.timestamp(), released_at.timestamp())
    return ledger.value, datetime.fromtimestamp(ledger.as_of_s, UTC)


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


def _complete_gang_member(
    session: Session,
    run: JobRunRow,
    job: JobRow,
    run_to: RunStatus,
    why: str,
    values: dict[str, Any],
    now: datetime,
    retry_backoff: tuple[float, float],
) -> tuple[CompletionResult, str]:
    """One member of the job's current gang attempt ended (in complete_run's transaction,
    after its run went terminal; the first member to end unsuccessfully carries the
    attempt's ``gang_outcome``).

    * If it ended unsuccessfully, every other live member is marked PREEMPTING (reason
      ``gang``); the stop driver stops them (SIGTERM, grace, SIGKILL, verified).
    * The member's GPUs stay reserved while any other member is live: a gang's GPUs come
      back together, only once every member is verified gone, so no GPU of a stopping gang
      is reused while part of it still runs.
    * The last member to end releases every member's reservation, charges the team, and
      moves the job: SUCCEEDED when every member succeeded (result: rank 0's manifest),
      else the cause's outcome (a retry is ONE new gang attempt with a new token).
    """
    failed = run_to != RunStatus.SUCCEEDED
    if values.get("charged_to") == "node":
        _cordon_if_failing(session, run.node_id, now)
    if failed:
        stop_gang(
            session,
            job.id,
            run.token,
            cause_run_id=run.id,
            message=f"rank {run.rank} of the gang ended ({why}); stopping the whole attempt",
        )
    ended = finish_gang_if_done(session, job, run.token, now, retry_backoff=retry_backoff)
    if ended is None:
        return CompletionResult.ACCEPTED, f"rank {run.rank}: {why}; waiting for the other ranks"
    return CompletionResult.ACCEPTED, ended


def finish_gang_if_done(
    session: Session,
    job: JobRow,
    token: int,
    now: datetime,
    *,
    retry_backoff: tuple[float, float] = (10.0, 300.0),
) -> str | None:
    """If every member of the gang attempt ``token`` of ``job`` has ended: release every
    member's RESERVED/CONFIRMED reservation (a fenced member's QUARANTINED one waits for its
    agent's word), charge the team, and move the job (:func:`_end_gang_attempt`). Returns
    the sentence of the job's move, or None while a member is still live."""
    session.flush()
    members = gang_members(session, job.id, token)
    for m in members:
        session.refresh(m)
    if any(m.status not in RUN_TERMINAL for m in members):
        return None
    for m in members:  # the last one: every member's GPUs come back together
        if m.status == RunStatus.FENCED:
            continue
        gpus = allocate.release(
            session, run_id=m.id, now=now, message=f"gang attempt ended (rank {m.rank})"
        )
        charge_usage(session, job.team_id, gpus, reserved_at=m.created_at, released_at=now)
    return _end_gang_attempt(session, job, members, now, retry_backoff)


def _end_gang_attempt(
    session: Session,
    job: JobRow,
    members: list[JobRunRow],
    now: datetime,
    retry_backoff: tuple[float, float],
) -> str:
    """Move the job once every member of its gang attempt has ended."""
    rank0 = members[0]
    token = rank0.token
    job_values: dict[str, object] = {}
    if all(m.status == RunStatus.SUCCEEDED for m in members):
        job_to, why = JobStatus.SUCCEEDED, f"all {len(members)} ranks exited 0; manifests verified"
        job_values = {"finished_at": now, "failure_reason": None, "result_uri": rank0.manifest_uri}
    else:
        ended = sorted(
            (m for m in members if m.gang_outcome is not None),
            key=lambda m: (m.finished_at or now, m.rank),
        )
        cause = ended[0] if ended else None
        if cause is not None and cause.gang_outcome is not None:
            job_to = JobStatus(cause.gang_outcome)
            why = f"rank {cause.rank}: {cause.message or cause.status}"
        else:  # every member was stopped with the gang (e.g. its cause was fenced)
            job_to = _failed_next(session, job, True) or JobStatus.PENDING
            why = "every member of the gang attempt was stopped"
        if job.cancel_requested and job_to == JobStatus.PENDING:
            job_to = JobStatus.CANCELLED
        if job_to == JobStatus.PENDING:
            blame = cause.charged_to if cause is not None else None
            preempted = cause is not None and cause.status == RunStatus.PREEMPTED
            job_values = _requeue_values(
                session,
                job.id,
                now,
                keeps_place=preempted or blame in ("node", "refused"),
                backs_off=blame == "job",
                after=why,
                retry_backoff=retry_backoff,
            )
        else:
            job_values = {
                "finished_at": now,
                "failure_reason": None if job_to == JobStatus.CANCELLED else why,
            }
    transition(
        session,
        Machine.JOB,
        job.id,
        job_to,
        now=now,
        frm=[job.status],
        guard={"fencing_epoch": token},
        values=job_values,
        job_id=job.id,
        run_id=rank0.id,
        message=f"gang attempt {rank0.attempt} ended: {why}",
    )
    return why
