"""The node an operator names, as the fleet knows it.

``admin node forget`` deletes a node's capacity and GPU rows but keeps its ``nodes`` row while
attempts or reservations refer to it (their history names the node). Such a row is not a
node of the fleet: ``gpufleet nodes`` does not list it, and every operator action on it
(cordon, drain, fence, labels, revoke, forget again) answers NotFound, as for an id never
seen. A registration of the same id (a new join token) brings it back with fresh capacity.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import NotFound
from gpufleet.store.tables import NodeCapacityRow, NodeRow


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
