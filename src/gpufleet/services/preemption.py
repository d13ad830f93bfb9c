"""Applying the policy's preemption decisions (seed DD5), and the GPU holds they create.

A ``Preempt`` decision becomes, in one transaction checked against the leader epoch: every
victim attempt RUNNING -> PREEMPTING (durable; its GPUs stay reserved) and a hold of the freed
GPUs for the preemptor. The StopRun calls go out after commit; each victim's GPUs come back
only when its agent reports the processes gone, and the hold keeps them for the preemptor
until it is placed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.states import JobStatus, RunStatus
from gpufleet.policy.decisions import Preempt
from gpufleet.services.run_stop import request_stop
from gpufleet.store import leader
from gpufleet.store.dialect import db_now, insert_if_absent
from gpufleet.store.tables import GpuHoldRow, JobRow, JobRunRow, NodeRow


@dataclass(frozen=True, slots=True)
class StopOrder:
    """A StopRun to send after commit."""

    run_id: str
    token: int
    address: str
    node_id: str = ""


def apply_preempt(
    session: Session, decision: Preempt, *, leader_holder: str, leader_epoch: int
) -> list[StopOrder]:
    """Mark the victims PREEMPTING and hold their GPUs for ``decision.for_job_id``.

    Victims already stopping or finished are skipped (the decision may be a pass old).
    Raises NotLeader when the lease moved on.
    """
    leader.assert_leader(session, leader_holder, leader_epoch)
    now = db_now(session)
    orders: list[StopOrder] = []
    rows = session.execute(
        select(JobRunRow, NodeRow.address)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .where(JobRunRow.id.in_(decision.victim_run_ids))
        .order_by(JobRunRow.id)
    ).all()
    addresses = {run.id: (address, run.node_id, run.token) for run, address in rows}
    marked: list[str] = []
    for run, _ in rows:
        if run.id in marked or run.status not in (RunStatus.ASSIGNED, RunStatus.RUNNING):
            continue
        # a gang victim stops as one unit: request_stop marks every live member, whatever
        # members the decision listed
        marked += request_stop(
            session,
            run.id,
            run.token,
            "preempt",
            message=f"preempted for {decision.for_job_id} ({decision.reason})",
            for_job_id=decision.for_job_id,
        )
    if marked:  # the ground, for the displacement budget and anti-thrash window (DD7)
        session.execute(
            update(JobRunRow)
            .where(JobRunRow.id.in_(marked))
            .values(preempt_reason=decision.reason[:16])
        )
    missing = sorted(set(marked) - set(addresses))
    if missing:  # members the decision did not list
        for run, address in session.execute(
            select(JobRunRow, NodeRow.address)
            .join(NodeRow, NodeRow.id == JobRunRow.node_id)
            .where(JobRunRow.id.in_(missing))
        ).all():
            addresses[run.id] = (address, run.node_id, run.token)
    for run_id in sorted(marked):
        address, node_id, token = addresses[run_id]
        orders.append(StopOrder(run_id, token, address, node_id))
    gpus = decision.gpu_count or sum(len(r.gpu_ids) for r, _ in rows)
    # one hold per (job, node): a gang preemptor may hold GPUs on several nodes
    # insert-or-update without a read first (a read then an insert is the race class of a
    # unique violation; the leader is the only writer here, but the shape costs nothing)
    if not insert_if_absent(
        session,
        GpuHoldRow.__table__,
        {
            "job_id": decision.for_job_id,
            "node_id": decision.node_id,
            "gpu_count": gpus,
            "reason": decision.reason,
            "since": now,
        },
    ):
        session.execute(
            update(GpuHoldRow)
            .where(
                GpuHoldRow.job_id == decision.for_job_id,
                GpuHoldRow.node_id == decision.node_id,
            )
            .values(gpu_count=gpus, reason=decision.reason)
        )
    return orders


def release_holds(session: Session, job_ids: Iterable[str]) -> int:
    """Delete the holds the policy released, and those whose job is no longer PENDING
    (cancelled, or placed by another path). Returns how many were deleted."""
    ids = set(job_ids)
    ids |= set(
        session.scalars(
            select(GpuHoldRow.job_id)
            .join(JobRow, JobRow.id == GpuHoldRow.job_id)
            .where(JobRow.status != JobStatus.PENDING)
        )
    )
    if not ids:
        return 0
    result = session.execute(delete(GpuHoldRow).where(GpuHoldRow.job_id.in_(ids)))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
