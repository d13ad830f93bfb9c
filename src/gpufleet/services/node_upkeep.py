"""The reconciler's node upkeep (the failure detector and drains): one read says which step
has anything to do (``upkeep_due``), then silent nodes become SUSPECT, DRAINING nodes with no
attempt left become CORDONED, and nodes silent past the fence timeout have their attempts
fenced (``node_fence.fence_node``). Each step is its own transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import bindparam, exists, select
from sqlalchemy.orm import Session

from gpufleet.domain.states import RUN_ACTIVE, Machine, NodeStatus
from gpufleet.services.node_fence import Fenced, fence_node
from gpufleet.services.node_lookup import in_fleet
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRunRow, NodeRow
from gpufleet.store.transitions import transition


def active_runs_on(session: Session, node_id: str) -> list[tuple[str, str, str]]:
    """(run_id, job_id, status) of the node's active attempts."""
    return [
        (r, j, s)
        for r, j, s in session.execute(
            select(JobRunRow.id, JobRunRow.job_id, JobRunRow.status)
            .where(JobRunRow.node_id == node_id, JobRunRow.status.in_(sorted(RUN_ACTIVE)))
            .order_by(JobRunRow.id)
        )
    ]


@dataclass(frozen=True, slots=True)
class UpkeepDue:
    """Which of the failure detector's write steps have anything to do (:func:`upkeep_due`)."""

    suspect: bool
    """A HEALTHY or UNHEALTHY node is silent past the suspect cutoff."""
    drains: bool
    """A node is DRAINING."""
    fence: bool
    """A SUSPECT, CORDONED or DRAINING node is silent past the fence cutoff."""


def _silent_suspectable(cutoff: Any) -> Any:
    """A HEALTHY or UNHEALTHY node of the fleet with no heartbeat since ``cutoff`` (a datetime
    or a bind parameter): what :func:`mark_silent_nodes_suspect` moves to SUSPECT."""
    return (
        NodeRow.status.in_([NodeStatus.HEALTHY, NodeStatus.UNHEALTHY])
        & (NodeRow.last_heartbeat_at < cutoff)
        & in_fleet()
    )


def _silent_fenceable(cutoff: Any) -> Any:
    """A SUSPECT, CORDONED or DRAINING node of the fleet with no heartbeat since ``cutoff``:
    what :func:`fence_silent_nodes` fences."""
    return (
        NodeRow.status.in_([NodeStatus.SUSPECT, NodeStatus.CORDONED, NodeStatus.DRAINING])
        & (NodeRow.last_heartbeat_at < cutoff)
        & in_fleet()
    )


@cache
def _upkeep_due_query() -> Any:
    """:func:`upkeep_due`'s one read, built once (``p_suspect``, ``p_fence``)."""
    at = NodeRow.last_heartbeat_at.type
    return select(
        exists().where(_silent_suspectable(bindparam("p_suspect", type_=at))),
        exists().where(NodeRow.status == NodeStatus.DRAINING),
        exists().where(_silent_fenceable(bindparam("p_fence", type_=at))),
    )


def upkeep_due(session: Session, *, suspect_before: datetime, fence_before: datetime) -> UpkeepDue:
    """One read of the nodes: whether :func:`mark_silent_nodes_suspect` (heartbeat before
    ``suspect_before``), :func:`finish_drains` and :func:`fence_silent_nodes` (heartbeat
    before ``fence_before``) would find a node, so that the reconciler opens their write
    transactions only then (on SQLite each takes the single writer lock). Each step checks
    again in its own transaction; a node that turns due just after this read waits for the
    next pass."""
    row = session.execute(
        _upkeep_due_query(), {"p_suspect": suspect_before, "p_fence": fence_before}
    ).one()
    return UpkeepDue(bool(row[0]), bool(row[1]), bool(row[2]))


def finish_drains(session: Session) -> list[str]:
    """DRAINING nodes with no active attempt left -> CORDONED (drained). Returns their ids."""
    now = db_now(session)
    done = []
    for node_id in session.scalars(
        select(NodeRow.id).where(NodeRow.status == NodeStatus.DRAINING)
    ):
        if active_runs_on(session, node_id):
            continue
        transition(
            session,
            Machine.NODE,
            node_id,
            NodeStatus.CORDONED,
            now=now,
            frm=[NodeStatus.DRAINING],
            message="drained: no attempt left on the node",
            node_id=node_id,
        )
        done.append(node_id)
    return done


def mark_silent_nodes_suspect(session: Session, silent_for_s: float) -> list[str]:
    """HEALTHY nodes with no heartbeat for ``silent_for_s`` -> SUSPECT (no placements there;
    nothing is released: silence is a question, not an answer). Returns their ids."""
    now = db_now(session)
    from datetime import timedelta

    cutoff: datetime = now - timedelta(seconds=silent_for_s)
    ids = list(session.scalars(select(NodeRow.id).where(_silent_suspectable(cutoff))))
    for node_id in ids:
        transition(
            session,
            Machine.NODE,
            node_id,
            NodeStatus.SUSPECT,
            now=now,
            frm=[NodeStatus.HEALTHY, NodeStatus.UNHEALTHY],
            values={"status_reason": f"no heartbeat for over {silent_for_s:.0f} s"},
            message=f"no heartbeat for over {silent_for_s:.0f} s",
            node_id=node_id,
        )
    return ids


def fence_silent_nodes(
    session: Session,
    *,
    silent_for_s: float,
    max_node_failures: int,
    leader_holder: str,
    leader_epoch: int,
) -> dict[str, list[Fenced]]:
    """The failure detector's second step: SUSPECT nodes silent for ``silent_for_s`` become
    QUARANTINED with their attempts fenced; CORDONED/DRAINING nodes that fall silent keep
    their status but their attempts are fenced too. One transaction per call, leader-fenced.
    Returns node id -> fenced attempts."""
    from datetime import timedelta

    now = db_now(session)
    cutoff = now - timedelta(seconds=silent_for_s)
    rows = session.execute(
        select(NodeRow.id, NodeRow.status).where(
            _silent_fenceable(cutoff),
        )
    ).all()
    out: dict[str, list[Fenced]] = {}
    for node_id, status in rows:
        if (
            status != NodeStatus.SUSPECT
            and not session.execute(
                select(JobRunRow.id)
                .where(JobRunRow.node_id == node_id, JobRunRow.status.in_(sorted(RUN_ACTIVE)))
                .limit(1)
            ).first()
        ):
            continue
        out[node_id] = fence_node(
            session,
            node_id,
            reason=f"no heartbeat for {silent_for_s:.0f} s (fence timeout)",
            max_node_failures=max_node_failures,
            node_to=NodeStatus.QUARANTINED if status == NodeStatus.SUSPECT else None,
            leader_holder=leader_holder,
            leader_epoch=leader_epoch,
        )
    return out
