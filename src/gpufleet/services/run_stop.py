"""Stopping an attempt (seed DD5): the durable stop request (cancel, preempt, timeout, requeue,
gang) that marks an active attempt PREEMPTING, and a gang attempt stopped as one unit. GPUs
stay reserved until the agent reports the processes gone (``run_completion``).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.domain.states import Machine, RunStatus
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRunRow
from gpufleet.store.transitions import transition


def gang_members(session: Session, job_id: str, token: int) -> list[JobRunRow]:
    """Every member of the gang attempt of ``job_id`` with ``token``, in rank order."""
    return list(
        session.scalars(
            select(JobRunRow)
            .where(JobRunRow.job_id == job_id, JobRunRow.token == token)
            .order_by(JobRunRow.rank)
        )
    )


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
