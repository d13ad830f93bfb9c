"""Operator actions on nodes: status changes (cordon, drain, uncordon: ``set_node_status``),
the fence of a node confirmed dead (``operator_fence``) and image pre-pulls
(``prepull_images``, handed out in the nodes' next heartbeats).
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, ValidationFailed
from gpufleet.domain.states import NODE_TRANSITIONS, Machine, NodeStatus
from gpufleet.services.node_fence import Fenced, fence_node, release_gone_quarantined
from gpufleet.services.node_health import set_status_reason
from gpufleet.services.node_lookup import fleet_node, refuse_if_alive
from gpufleet.services.node_register import INVENTORY_DRAIN
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import NodeCapacityRow, NodeRow
from gpufleet.store.transitions import transition


def set_node_status(
    session: Session, node_id: str, to: NodeStatus, *, message: str, reason: str | None = None
) -> str:
    """Operator actions (cordon, drain, uncordon...). ``reason`` is kept on the node (shown
    by ``gpufleet nodes`` and ``why``); HEALTHY clears it. Returns the previous status. A
    node already in ``to`` stays there (no event); only a given ``reason`` is updated.

    Raises:
        NotFound: no such node, or it was forgotten.
        IllegalTransition: the node's status has no edge to ``to`` (e.g. QUARANTINED ->
            DRAINING: its GPUs are not known free; fence it or wait for its agent).
        Conflict: uncordon (``to`` HEALTHY) of a node drained for a change of GPUs that its
            agent has not registered since (``NodeRow.reported_gpus`` set).
    """
    node = fleet_node(session, node_id)
    if to == NodeStatus.HEALTHY and node.reported_gpus is not None:
        raise Conflict(
            f"node {node_id} still has the GPUs recorded before its agent reported others"
            f" ({_pending_inventory(session, node)}); restart its agent once it is drained,"
            " then uncordon it",
            field="node_id",
        )
    why = None if to == NodeStatus.HEALTHY else (reason or message)
    if why and node.reported_gpus is not None:
        # still not the agent's GPUs: say so last
        why = f"{why}; {_pending_inventory(session, node)}; {INVENTORY_DRAIN}"
    if node.status == to and (node.status, to) not in NODE_TRANSITIONS:
        # drain of a DRAINING node, uncordon of a HEALTHY one: already there, a no-op (as
        # Slurm's `scontrol update state=drain` on a draining node); a new reason is kept
        if reason:
            set_status_reason(session, node_id, why)
        return node.status
    return transition(
        session,
        Machine.NODE,
        node_id,
        to,
        now=db_now(session),
        frm=[node.status],
        values={"status_reason": why},
        message=f"{message}: {reason}" if reason else message,
        node_id=node_id,
    )


def _pending_inventory(session: Session, node: NodeRow) -> str:
    """What the agent of a node with ``reported_gpus`` set reported, against what is recorded
    (for reasons and errors)."""
    cap = session.get(NodeCapacityRow, node.id)
    recorded = f"{cap.total_gpus} recorded" if cap is not None else "recorded"
    return (
        f"node {node.id} now reports {node.reported_gpus} {node.reported_gpu_type} GPU(s)"
        f" ({recorded})"
    )


def operator_fence(
    session: Session,
    node_id: str,
    *,
    reason: str,
    max_node_failures: int,
    live_within_s: float = 0.0,
    force: bool = False,
) -> tuple[list[Fenced], float]:
    """``gpufleet admin node fence NODE --confirm-dead``: the operator vouches that the node
    is dead (powered off, re-installed). Its remaining attempts are fenced, every QUARANTINED
    reservation of it is EXPIRED (its GPUs offered again) and the node is FENCED (no
    placements until ``admin node uncordon``). Returns (attempts fenced, GPUs returned).

    ``live_within_s``: the heartbeat window (seconds; ``suspect_after_missed`` heartbeat
    intervals): a node heard from within it, neither FENCED nor revoked, looks alive and is
    fenced only with ``force`` (its jobs' processes would keep running on GPUs offered to
    others); the same rule as ``admin node forget`` (``node_lookup.refuse_if_alive``).
    0 = no check.

    Raises:
        NotFound: no such node, or it was forgotten (never claimed FENCED).
        Conflict: the node looks alive and not ``force`` (field ``force``; the message says
            when it was last heard from).
    """
    node = fleet_node(session, node_id, for_update=True)
    if not force:
        refuse_if_alive(
            session,
            node,
            live_within_s,
            action="fencing it would offer GPUs to other jobs while its jobs' processes"
            " may still run on them",
            force_hint='fence it anyway with --force (REST: "force": true)',
        )
    fenced = fence_node(
        session,
        node_id,
        reason=f"operator fence: {reason}",
        max_node_failures=max_node_failures,
        node_to=NodeStatus.FENCED,
    )
    back = release_gone_quarantined(
        session, node_id, None, message=f"operator confirmed the node dead: {reason}"
    )
    return fenced, back


def prepull_images(session: Session, image: str, gpu_type: str | None = None) -> list[str]:
    """Ask every schedulable node (of ``gpu_type``, if given) that does not report ``image``
    to pull it; delivered in each node's next heartbeat answer. Returns the node ids asked.

    Raises:
        ValidationFailed: ``image`` is empty or has whitespace (field ``image``).
    """
    if not image or any(c.isspace() for c in image) or len(image) > 512:
        raise ValidationFailed("image must be a non-empty image reference", field="image")
    rows = session.scalars(
        select(NodeRow).where(NodeRow.status == NodeStatus.HEALTHY).order_by(NodeRow.id)
    ).all()
    asked = []
    for node in rows:
        if gpu_type and node.gpu_type != gpu_type:
            continue
        if any(i.get("name") == image for i in node.images or []):
            continue
        pending = list(node.prepull or [])
        if image not in pending:
            pending.append(image)
        session.execute(update(NodeRow).where(NodeRow.id == node.id).values(prepull=pending))
        asked.append(node.id)
    return asked
