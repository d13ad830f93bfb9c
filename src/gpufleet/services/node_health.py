"""Node health and node problems: a node's status on its own word, and what is wrong with the
nodes a job waits on.

A failed health check (a heartbeat's, or the agent refusing work) makes a HEALTHY or SUSPECT
node UNHEALTHY (no placements), a passing one HEALTHY again; ``back_to_healthy`` ends any of a
node's problems (SUSPECT, UNHEALTHY, QUARANTINED) in one audited transition and is shared by
registration, heartbeats and fencing. ``node_problems`` explains the nodes for ``why`` and
``status``.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpufleet.domain.states import JobStatus, Machine, NodeStatus
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, NodeCapacityRow, NodeRow
from gpufleet.store.transitions import transition


def back_to_healthy(
    session: Session, node_id: str, *, frm: NodeStatus, now: datetime, message: str
) -> None:
    """The node's problem is over: ``frm`` -> HEALTHY, its status reason cleared (one
    transition, audited with ``message``)."""
    transition(
        session,
        Machine.NODE,
        node_id,
        NodeStatus.HEALTHY,
        now=now,
        frm=[frm],
        values={"status_reason": None},
        node_id=node_id,
        message=message,
    )


def set_status_reason(
    session: Session, node_id: str, reason: str | None, **values: object
) -> None:
    """Change why a node is in its status without a transition (the status stays; a
    transition sets the reason with it through ``values``), with ``values`` the other columns
    that change with the reason (the reported inventory of ``node_register``)."""
    session.execute(
        update(NodeRow).where(NodeRow.id == node_id).values(status_reason=reason, **values)
    )


def apply_health(session: Session, node_id: str, health: str, *, now: datetime) -> None:
    """HEALTHY/SUSPECT -> UNHEALTHY on a failed check, UNHEALTHY -> HEALTHY when it passes;
    other statuses (an operator's cordon, quarantine) are left alone. Reads the node's
    status afresh (earlier steps of the same transaction may have moved it)."""
    row = session.execute(
        select(NodeRow.status, NodeRow.status_reason).where(NodeRow.id == node_id)
    ).first()
    if row is None:
        return
    status, reason = row
    if health != "HEALTHY" and status in (NodeStatus.HEALTHY, NodeStatus.SUSPECT):
        transition(
            session,
            Machine.NODE,
            node_id,
            NodeStatus.UNHEALTHY,
            now=now,
            frm=[status],
            values={"status_reason": health},
            node_id=node_id,
            message=health,
        )
    elif health != "HEALTHY" and status == NodeStatus.UNHEALTHY:
        if reason != health:
            set_status_reason(session, node_id, health)
    elif health == "HEALTHY" and status == NodeStatus.UNHEALTHY:
        back_to_healthy(
            session, node_id, frm=NodeStatus.UNHEALTHY, now=now, message="health check passed"
        )


def mark_unhealthy(session: Session, node_id: str, reason: str) -> None:
    """The agent refused work as unhealthy (e.g. its disk): no placements there until its
    heartbeat reports HEALTHY again."""
    apply_health(session, node_id, reason or "node unhealthy", now=db_now(session))


def node_problems(session: Session, job: JobRow) -> list[dict[str, str | None]]:
    """Nodes a job waits on that cannot take work now (for ``why`` and ``status``): for a
    SCHEDULED/RUNNING job, its attempt's node if it is not HEALTHY (e.g. SUSPECT: its start
    or its stop waits for the node); for a PENDING job, the nodes that could hold it but are
    SUSPECT, QUARANTINED, UNHEALTHY, CORDONED, DRAINING or FENCED. Each:
    ``{"node_id", "status", "reason"}``."""

    def one(n: NodeRow) -> dict[str, str | None]:
        return {"node_id": n.id, "status": n.status, "reason": n.status_reason}

    if job.status in (JobStatus.SCHEDULED, JobStatus.RUNNING) and job.current_run_id:
        # every member's node of a gang attempt (they share the job's token)
        members = session.scalars(
            select(NodeRow)
            .join(JobRunRow, JobRunRow.node_id == NodeRow.id)
            .where(JobRunRow.job_id == job.id, JobRunRow.token == job.fencing_epoch)
            .order_by(NodeRow.id)
        ).all()
        return [one(n) for n in members if n.status != NodeStatus.HEALTHY]
    if job.status != JobStatus.PENDING:
        return []
    types = set((job.spec.get("resources") or {}).get("gpu_types") or [])
    rows = session.execute(
        select(NodeRow, NodeCapacityRow.total_gpus)
        .join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
        .where(NodeRow.status != NodeStatus.HEALTHY)
        .order_by(NodeRow.id)
    ).all()
    return [
        one(n)
        for n, total in rows
        if total >= job.gpu_count and (not types or n.gpu_type in types)
    ]
