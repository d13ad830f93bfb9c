"""What an ended attempt leaves behind, shared by completion (``run_completion``) and fencing
(``services.nodes``): whether an attempt is the job's current one, the team charged the
GPU-time it held, the job's next status after a failure (a retry with backoff, or FAILED), and
the end of a gang attempt once every member has ended (the job moved).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import event, func, or_, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.states import RUN_TERMINAL, JobStatus, Machine, RunStatus
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.usage import UsageLedger
from gpufleet.services.run_stop import gang_members
from gpufleet.store import allocate, outbox  # noqa: F401  (outbox: its before_commit first)
from gpufleet.store.tables import JobRow, JobRunRow, TeamRow
from gpufleet.store.transitions import transition


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


def failed_next(session: Session, job: JobRow, current: bool) -> JobStatus | None:
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


_CHARGES = "gpufleet.team_charges"


def charge_usage(
    session: Session,
    team_id: str,
    gpus: float,
    *,
    reserved_at: datetime,
    released_at: datetime,
    half_life_s: float = PolicyConfig().usage_half_life_s,
    known: tuple[float, datetime | None] | None = None,
) -> None:
    """Charge the GPU-time one attempt held, from reservation to release, whatever its
    outcome (succeeded, failed, preempted, cancelled), decayed as ``policy.usage`` defines; so
    a retry or a preemption costs its team exactly the GPU-time it really held.

    The charge is queued on ``session`` and written as the transaction's last statement, at
    its commit (:func:`write_team_charges`): the team row is every attempt's of that team, so
    it is locked only from that UPDATE to the commit, and a submit's foreign-key check on it
    is never kept waiting (the row is updated, never locked FOR UPDATE). Charges commute
    (each is an exact integral decayed to a common date, ``policy.usage``), so their order
    across transactions does not matter.

    ``known``: the team's ``(usage_gpu_s, usage_as_of)`` as the caller read them (unlocked)
    in this transaction: the guarded UPDATE is tried with those values first."""
    if gpus <= 0:
        return
    charges: dict[str, _TeamCharges] = session.info.setdefault(_CHARGES, {})
    queued = charges.setdefault(team_id, _TeamCharges(known, half_life_s))
    queued.attempts.append((gpus, reserved_at, released_at))


@dataclass
class _TeamCharges:
    known: tuple[float, datetime | None] | None
    half_life_s: float
    attempts: list[tuple[float, datetime, datetime]] = field(default_factory=list)

    def applied(self, usage_gpu_s: float, usage_as_of: datetime | None) -> tuple[float, datetime]:
        value, as_of = usage_gpu_s, usage_as_of
        for gpus, reserved_at, released_at in self.attempts:
            value, as_of = _charged(value, as_of, gpus, reserved_at, released_at, self.half_life_s)
        assert as_of is not None  # at least one attempt
        return value, as_of


def write_team_charges(session: Session) -> None:
    """Write the team charges queued on ``session`` (:func:`charge_usage`): per team one
    UPDATE guarded by the values it read (optimistic: no lock before it); when another
    transaction changed them meanwhile, the row is locked FOR NO KEY UPDATE (which a
    foreign-key check does not wait for), read again and charged."""
    charges: dict[str, _TeamCharges] | None = session.info.pop(_CHARGES, None)
    if not charges:
        return
    t = TeamRow.__table__.c
    for team_id in sorted(charges):  # one order everywhere: two transactions never deadlock
        queued = charges[team_id]
        known = queued.known
        if known is None:
            row = session.execute(
                select(t.usage_gpu_s, t.usage_as_of).where(t.id == team_id)
            ).first()
            if row is None:
                continue
            known = (row[0], row[1])
        value, as_of_at = queued.applied(*known)
        same_as_of = t.usage_as_of.is_(None) if known[1] is None else t.usage_as_of == known[1]
        hit = session.execute(
            update(TeamRow)
            .where(t.id == team_id, t.usage_gpu_s == known[0], same_as_of)
            .values(usage_gpu_s=value, usage_as_of=as_of_at)
            .execution_options(synchronize_session=False)
        )
        if hit.rowcount == 1:  # type: ignore[attr-defined]
            continue
        row = session.execute(
            select(t.usage_gpu_s, t.usage_as_of)
            .where(t.id == team_id)
            .with_for_update(key_share=True)
        ).first()
        if row is None:
            continue
        value, as_of_at = queued.applied(row[0], row[1])
        session.execute(
            update(TeamRow)
            .where(t.id == team_id)
            .values(usage_gpu_s=value, usage_as_of=as_of_at)
            .execution_options(synchronize_session=False)
        )


@event.listens_for(Session, "before_commit")
def _charge_at_commit(session: Session) -> None:
    """Queued team charges go last before the commit (after the outbox's batched INSERTs,
    whose listener is registered first: ``store.outbox`` is imported above)."""
    write_team_charges(session)


@event.listens_for(Session, "after_rollback")
def _drop_charges(session: Session) -> None:
    """A rolled-back transaction's charges are dropped with it."""
    session.info.pop(_CHARGES, None)


def _charged(
    usage_gpu_s: float,
    usage_as_of: datetime | None,
    gpus: float,
    reserved_at: datetime,
    released_at: datetime,
    half_life_s: float,
) -> tuple[float, datetime]:
    """A team's (usage_gpu_s, usage_as_of) after charging one attempt (``policy.usage``).

    Exact in any order: an attempt released before ``usage_as_of`` (its transaction
    committed after a later one's) is decayed to ``usage_as_of``, which stays; a later one
    moves it forward. (The stored value was once taken as of the earlier release instead,
    which left the later charge undecayed and the earlier one decayed twice.)"""
    as_of = (usage_as_of or released_at).timestamp()
    ledger = UsageLedger(usage_gpu_s, as_of, half_life_s)
    ledger.charge_attempt(gpus, reserved_at.timestamp(), released_at.timestamp())
    return ledger.value, datetime.fromtimestamp(ledger.as_of_s, UTC)


def requeue_values(
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


def finish_gang_if_done(
    session: Session,
    job: JobRow,
    token: int,
    now: datetime,
    *,
    retry_backoff: tuple[float, float] = (10.0, 300.0),
) -> str | None:
    """If every member of the gang attempt ``token`` of ``job`` has ended: release any
    member's RESERVED/CONFIRMED reservation still held (each member's own completion
    releases its GPUs as it ends, ``run_completion.complete_run``; a fenced member's
    QUARANTINED one waits for its agent's word), charge the team, and move the job
    (:func:`_end_gang_attempt`). Returns the sentence of the job's move, or None while a
    member is still live."""
    session.flush()
    members = gang_members(session, job.id, token)
    for m in members:
        session.refresh(m)
    if any(m.status not in RUN_TERMINAL for m in members):
        return None
    for m in members:  # a member ended without its own release (none on the usual paths)
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
            job_to = failed_next(session, job, True) or JobStatus.PENDING
            why = "every member of the gang attempt was stopped"
        if job.cancel_requested and job_to == JobStatus.PENDING:
            job_to = JobStatus.CANCELLED
        if job_to == JobStatus.PENDING:
            blame = cause.charged_to if cause is not None else None
            preempted = cause is not None and cause.status == RunStatus.PREEMPTED
            job_values = requeue_values(
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
