"""The node an operator names, as the fleet knows it.

``admin node forget`` deletes a node's capacity and GPU rows but keeps its ``nodes`` row while
attempts or reservations refer to it (their history names the node). Such a row is not a
node of the fleet: ``gpufleet nodes`` does not list it, and every operator action on it
(cordon, drain, fence, labels, revoke, forget again) answers NotFound, as for an id never
seen. A registration of the same id (a new join token) brings it back with fresh capacity.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, NotFound
from gpufleet.domain.states import NodeStatus
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import NodeCapacityRow, NodeCertRow, NodeRow


def in_fleet() -> Any:
    """SQL: the ``nodes`` row being read has capacity rows (registered, not forgotten), for a
    ``WHERE`` over ``NodeRow`` (the failure detector leaves forgotten rows alone)."""
    return exists().where(NodeCapacityRow.node_id == NodeRow.id)


def is_forgotten(session: Session, node_id: str) -> bool:
    """True when ``node_id`` has no capacity row (never registered, or forgotten)."""
    return not session.execute(
        select(exists().where(NodeCapacityRow.node_id == node_id))
    ).scalar_one()


def fleet_node(session: Session, node_id: str, *, for_update: bool = False) -> NodeRow:
    """The row of a node in the fleet (``for_update``: locked).

    Raises:
        NotFound: no such node, or it was forgotten (field ``node_id``).
    """
    node = session.get(NodeRow, node_id, with_for_update=for_update)
    if node is None or is_forgotten(session, node_id):
        raise no_node(session, node_id)
    return node


def no_node(session: Session, node_id: str) -> NotFound:
    """The NotFound for ``node_id``; it says so when the id is of a forgotten node."""
    if session.get(NodeRow, node_id) is not None:
        return NotFound(
            f"no node {node_id!r} (it was forgotten: `gpufleet admin node forget`)",
            field="node_id",
        )
    return NotFound(f"no node {node_id!r}", field="node_id")


def is_cut_off(session: Session, node: NodeRow) -> bool:
    """True when the node's agent can no longer speak for it: the node is FENCED, or every
    certificate it ever had is revoked."""
    if node.status == NodeStatus.FENCED:
        return True
    certs = session.execute(
        select(NodeCertRow.revoked_at).where(NodeCertRow.node_id == node.id)
    ).all()
    return bool(certs) and all(c.revoked_at is not None for c in certs)


def refuse_if_alive(
    session: Session, node: NodeRow, live_within_s: float, *, action: str, force_hint: str
) -> None:
    """The liveness rule of the operator actions that assume a dead node (``admin node
    forget``, ``admin node fence --confirm-dead``): a node whose last heartbeat (database
    clock) is younger than ``live_within_s`` seconds (``suspect_after_missed`` heartbeat
    intervals) and that is not cut off (:func:`is_cut_off`) looks alive. 0 = no check.

    Raises:
        Conflict: the node looks alive (field ``force``); the message says when it was last
            heard from and how to override (``force_hint``).
    """
    if live_within_s <= 0 or node.last_heartbeat_at is None or is_cut_off(session, node):
        return
    now = db_now(session)
    last: datetime = node.last_heartbeat_at
    if last < now - timedelta(seconds=live_within_s):
        return
    ago = max(0.0, (now - last).total_seconds())
    raise Conflict(
        f"node {node.id} ({node.status}) was last heard from {ago:.1f} s ago "
        f"({last:%Y-%m-%d %H:%M:%S}Z), within the last {live_within_s:g} s "
        f"(suspect_after_missed heartbeat intervals): it looks alive, and {action}. Stop its "
        f"agent (or wait until it goes SUSPECT) first, or {force_hint}",
        field="force",
    )
