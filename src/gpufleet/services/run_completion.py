"""An attempt's end, committed once (seed DD2, DD8): the agent's (or the controller's) report
(:class:`Report`), the manifest verified before the transaction (:func:`verify_manifest`,
object-store I/O), and :func:`complete_run`: the run terminal, the job terminal or back to
PENDING, the reservation released and the team charged, in one transaction guarded by
``run_id + token``; a stale token changes nothing about the job. Start failures the node caused
are charged to it (auto-cordon); a gang member's end is settled with its gang.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Forbidden
from gpufleet.domain.manifest import MANIFEST_NAME, Manifest, file_problem
from gpufleet.domain.states import (
    RESERVATION_ACTIVE,
    RUN_TERMINAL,
    JobStatus,
    Machine,
    NodeStatus,
    RunStatus,
)
from gpufleet.domain.types import milli_of
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.services.run_settle import (
    charge_usage,
    failed_next,
    finish_gang_if_done,
    gang_cause,
    is_current,
    requeue_values,
)
from gpufleet.services.run_stop import GANG_STOP, stop_gang
from gpufleet.store import accounting, allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import as_utc, now_sql_for
from gpufleet.store.leader import assert_leader
from gpufleet.store.tables import (
    ApiTokenRow,
    JobRow,
    JobRunRow,
    NodeRow,
    ReservationRow,
    SchedulingEventRow,
    TeamRow,
)
from gpufleet.store.transitions import record_event, transition


class Outcome(enum.StrEnum):
    EXITED = "EXITED"
    STOPPED = "STOPPED"
    NEVER_STARTED = "NEVER_STARTED"


class CompletionResult(enum.StrEnum):
    ACCEPTED = "ACCEPTED"
    STALE = "STALE"
    REJECTED = "REJECTED"


@dataclass(frozen=True, slots=True)
class StopHandshake:
    """What a stop's checkpoint handshake did, as the agent reports it (seconds; see
    ``gpufleet.agent.checkpoint_signal``).

    Attributes:
        signalled: the job said its checkpoint was durable during the grace period.
        grace_s: the stop's grace period.
        signal_after_s: SIGTERM to the signal; None when not signalled.
        saved_s: grace the stop did not wait because of the signal (0: the job ended by
            itself first, or did not signal).
    """

    signalled: bool
    grace_s: float
    signal_after_s: float | None = None
    saved_s: float = 0.0

    def details(self) -> dict[str, Any]:
        """The ``checkpoint_handshake`` event's details."""
        out: dict[str, Any] = {"signalled": self.signalled, "grace_s": self.grace_s}
        if self.signal_after_s is not None:
            out["signal_after_s"] = self.signal_after_s
        out["saved_s"] = self.saved_s
        return out

    def describe(self) -> str:
        """One line for the event's message."""
        if not self.signalled:
            return f"no checkpoint signal during the {self.grace_s:g} s grace"
        return (
            f"checkpoint signalled {self.signal_after_s or 0.0:g} s after SIGTERM;"
            f" {self.saved_s:g} s of the {self.grace_s:g} s grace saved"
        )


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
    reason: str = ""  # machine-readable cause from the agent: "", OOM_KILLED or DISK_FULL
    node_refused: bool = False
    """With ``node_fault``: the agent refused the assignment on a failed health check."""
    ended_ago_s: float | None = None
    """Seconds from the attempt's end to the report's send, on the agent's clock (None:
    unknown): the end is dated that long before the report's receipt (:func:`ended_at`)."""
    resources: Mapping[str, int | float] | None = None
    """What the attempt used as its agent measured it (``peak_rss_bytes``, ``cpu_seconds``,
    ``gpu_util_pct``, ``gpu_mem_peak_bytes``; each absent when not measured): written on
    its usage record."""
    stop_handshake: StopHandshake | None = None
    """A stopped attempt's checkpoint handshake (None: no SIGTERM was sent): recorded as a
    ``checkpoint_handshake`` event of the attempt."""


def ended_at(
    received_at: datetime, ended_ago_s: float | None, *, started_at: datetime
) -> datetime:
    """When an attempt ended on the database's clock: ``received_at`` (the report's receipt)
    minus ``ended_ago_s`` (the agent's own measure of the time from the exit to the send,
    so its clock's skew cancels; the time in flight is not subtracted), clamped to
    ``[started_at, received_at]``. None or a negative delay (the agent's clock stepped
    back): ``received_at``."""
    if ended_ago_s is None or not ended_ago_s > 0:
        return received_at
    return max(started_at, received_at - timedelta(seconds=ended_ago_s))


OOM_KILLED = "OOM_KILLED"
DISK_FULL = "DISK_FULL"
"""The attempt failed with its scratch filesystem (``disk_mb``) full; not retried either."""


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
                run.priority or job.priority,
                milli_of(job.spec.get("resources", {}).get("gpu_fraction")),
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
        # the usage record ends at the exit, not when the report got here (a controller
        # away at the exit): charged only for the time the attempt really ran
        ended = ended_at(now, report.ended_ago_s, started_at=run.started_at or run.created_at)
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
            "finished_at": ended,  # the attempt's (its job's is the commit's, below)
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
            ended_at=ended,
            resources=report.resources,
        )
        if report.stop_handshake is not None and report.outcome == Outcome.STOPPED:
            record_event(
                session,
                "checkpoint_handshake",
                now=now,
                message=report.stop_handshake.describe(),
                job_id=job.id,
                run_id=run.id,
                node_id=run.node_id,
                details=report.stop_handshake.details(),
            )
        # the agent's word that this attempt's (this member's) processes are gone: its GPUs
        # come back now, a gang member's too (the invariant is per GPU: a member's GPUs are
        # not reused while its own processes may run, whatever its gang's other members do)
        gpus = allocate.release(
            session,
            run_id=run.id,
            now=now,
            message=f"agent reported {report.outcome.lower()}"
            + (f" (rank {run.rank})" if gang else ""),
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
        if gang:
            return _complete_gang_member(
                session, run, job, run_to, why, values, now, retry_backoff
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
                job_values = requeue_values(
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
                # a cancel's words are the attempt's event (just above): the job's says
                # what happened to the job, not the same sentence a second time
                message="cancelled by user"
                if run_to == RunStatus.CANCELLED and job_to == JobStatus.CANCELLED
                else why,
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
        return RunStatus.FAILED, failed_next(session, job, current), why
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
    if report.reason == DISK_FULL and report.outcome == Outcome.EXITED:
        # Not retried: a new attempt gets the same disk_mb and would fill it again.
        why = report.message or "DISK_FULL: the attempt filled its scratch filesystem"
        if not why.startswith(DISK_FULL):
            why = f"DISK_FULL: {why}"
        return RunStatus.FAILED, (JobStatus.FAILED if current else None), why
    if report.outcome == Outcome.NEVER_STARTED:
        why = f"never started: {report.message or 'the agent has no record of it'}"
    elif report.outcome == Outcome.STOPPED:
        why = f"stopped by the agent: {report.message or 'no longer authoritative'}"
    else:
        # the agent's note says what the code alone cannot ("exit status lost: conmon died,
        # processes verified gone", "killed with SIGKILL after 5 s grace")
        why = exit_reason(report.exit_code) + (f": {report.message}" if report.message else "")
    return RunStatus.FAILED, failed_next(session, job, current), why


def exit_reason(exit_code: int | None) -> str:
    """Why an attempt that ended by itself failed: its exit code, or the signal that killed
    it when the code is negative (the convention of Python's ``subprocess``: -9 = SIGKILL)."""
    if exit_code is not None and exit_code < 0:
        try:
            name = f" ({signal.Signals(-exit_code).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-exit_code}{name}"
    return f"exited with code {exit_code}"


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


def _node_faults_since(session: Session, node_id: str, since: datetime) -> int:
    """Start failures charged to ``node_id`` that ended at or after ``since``."""
    return int(
        session.execute(
            select(func.count())
            .select_from(JobRunRow)
            .where(
                JobRunRow.node_id == node_id,
                JobRunRow.charged_to == "node",
                JobRunRow.status == RunStatus.FAILED,
                JobRunRow.finished_at >= since,
            )
        ).scalar_one()
    )


def last_uncordon(session: Session, node_id: str, since: datetime) -> datetime | None:
    """When an operator last returned ``node_id`` to HEALTHY from CORDONED or DRAINING
    (its ``transition`` event) at or after ``since``; None if not since then. Read only when
    a node already has enough recent failures to be cordoned (rare): the events table has no
    index on nodes."""
    at = session.execute(
        select(func.max(SchedulingEventRow.at)).where(
            SchedulingEventRow.machine == Machine.NODE,
            SchedulingEventRow.entity_id == node_id,
            SchedulingEventRow.to_status == NodeStatus.HEALTHY,
            SchedulingEventRow.from_status.in_([NodeStatus.CORDONED, NodeStatus.DRAINING]),
            SchedulingEventRow.at >= since,
        )
    ).scalar_one_or_none()
    return as_utc(at) if at is not None else None


def _cordon_if_failing(session: Session, node_id: str, now: datetime) -> None:
    """Cordon a node charged with NODE_FAULTS_TO_CORDON start failures in the window; an
    uncordon starts the count again (failures before it are not counted)."""
    session.flush()
    since = now - timedelta(seconds=NODE_FAULT_WINDOW_S)
    recent = _node_faults_since(session, node_id, since)
    if recent >= NODE_FAULTS_TO_CORDON:
        uncordoned = last_uncordon(session, node_id, since)
        if uncordoned is not None:
            recent = _node_faults_since(session, node_id, uncordoned)
    node = session.get(NodeRow, node_id, with_for_update=True)
    if recent < NODE_FAULTS_TO_CORDON or node is None:
        return
    if node.status not in (NodeStatus.HEALTHY, NodeStatus.UNHEALTHY, NodeStatus.SUSPECT):
        return
    reason = (
        f"auto-cordoned: {recent} start failures caused by the node in the last"
        f" {NODE_FAULT_WINDOW_S:.0f} s (since its last uncordon, if later)"
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
    * The member's own GPUs were released by the caller (its agent's word that its
      processes are gone): a finished member does not hold its GPUs until the slowest
      member reports (a frozen node's member may not report before the fence).
    * The last member to end moves the job: SUCCEEDED when every member succeeded (result:
      rank 0's manifest), else the cause's outcome (a retry is ONE new gang attempt with a
      new token).
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
