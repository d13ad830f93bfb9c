"""Admin-set node labels (topology: ``rack``, ``switch``, ``zone`` ...).

The rules (two sources, admin wins, ``gpufleet/`` reserved) are in :mod:`gpufleet.domain.labels`.
The admin's labels live in ``nodes.admin_labels``; the agent's in ``nodes.labels``, which
:func:`gpufleet.services.nodes.register_node` replaces at every registration and never touches
``admin_labels``. Readers (``/v1/nodes``, the scheduler's snapshot, admission's node_selector
check) use :func:`gpufleet.domain.labels.effective_labels`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from gpufleet.domain.labels import effective_labels, validate_labels
from gpufleet.services.job_admission import forget_fleet_shapes
from gpufleet.services.node_lookup import fleet_node
from gpufleet.store.tables import NodeRow
from gpufleet.store.transitions import record_event


def describe(node: NodeRow) -> dict[str, Any]:
    """``{node_id, labels (effective), admin_labels, agent_labels}`` of one node row."""
    agent = dict(node.labels or {})
    admin = dict(node.admin_labels or {})
    return {
        "node_id": node.id,
        "labels": effective_labels(agent, admin),
        "admin_labels": admin,
        "agent_labels": agent,
    }


def set_admin_labels(
    session: Session,
    node_id: str,
    changes: Mapping[str, str | None],
    *,
    replace: bool = False,
) -> dict[str, Any]:
    """Set (value) or remove (None) the admin labels of ``node_id``; with ``replace`` the
    node's admin labels become exactly ``changes`` (its None entries dropped) — a PUT, else a
    JSON merge patch (RFC 7386). Audited as a ``node_labels_set`` event; the scheduler sees
    the change at its next pass (it reads labels in every snapshot).

    Returns:
        :func:`describe` of the node after the change.

    Raises:
        ValidationFailed: a bad key or value (field ``labels.{key}``), a ``gpufleet/`` key, or
            more than ``MAX_LABELS`` admin labels (field ``labels``).
        NotFound: no such node, or it was forgotten (field ``node_id``).
    """
    validate_labels(changes)
    node = fleet_node(session, node_id, for_update=True)
    if not changes and not replace:
        return describe(node)  # an empty merge patch changes nothing: no event
    admin: dict[str, str] = {} if replace else dict(node.admin_labels or {})
    for key, value in changes.items():
        if value is None:
            admin.pop(key, None)
        else:
            admin[key] = value
    validate_labels(admin)  # the total count
    node.admin_labels = admin  # a new dict: the JSON column sees the change
    forget_fleet_shapes()  # admission's node_selector check reads labels too
    record_event(
        session,
        "node_labels_set",
        node_id=node_id,
        message="admin labels " + (", ".join(f"{k}={v}" for k, v in sorted(admin.items())) or "-"),
        details={"changes": dict(changes), "replace": replace},
    )
    session.flush()
    return describe(node)
