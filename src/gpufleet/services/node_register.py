"""Node registration and its inventory: a node inserted or refreshed when its agent starts,
and the drain that follows when the agent reports other GPUs than those reserved.

A re-registration with a lower agent epoch (the agent lost its state) fences the node's
attempts first (``node_fence.fence_lost_agent_state``). A changed GPU count or type while GPUs
are reserved is kept in ``NodeRow.reported_gpus``/``reported_gpu_type`` and drains the node;
the agent's next registration after the drain records the new GPUs (``node_admin`` refuses to
uncordon the node until then).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, ValidationFailed
from gpufleet.domain.states import Machine, NodeStatus
from gpufleet.domain.types import GpuDevice, GpuSharing
from gpufleet.services.job_admission import forget_fleet_shapes
from gpufleet.services.node_fence import fence_lost_agent_state
from gpufleet.services.node_health import back_to_healthy, set_status_reason
from gpufleet.store import allocate
from gpufleet.store.dialect import db_now, insert_if_absent
from gpufleet.store.tables import NodeRow
from gpufleet.store.transitions import record_event, transition


@dataclass(frozen=True, slots=True)
class NodeInventory:
    node_id: str
    address: str
    agent_epoch: int
    gpus: tuple[GpuDevice, ...]
    cpu: float
    memory_mb: int
    labels: dict[str, str]
    inventory_source: str
    gpu_sharing: str = GpuSharing.NONE
    """Whether and how the node's GPUs may be shared (``domain.types.GpuSharing``: agent
    ``--gpu-sharing``); a change applies to new shares only (shares placed stay)."""


def register_node(session: Session, inv: NodeInventory, *, max_node_failures: int = 3) -> None:
    """Insert or refresh a node. A re-registration may change address, labels and epoch;
    a changed GPU count or type while GPUs are reserved is not recorded: the node keeps its
    GPUs, the reported ones are kept in ``NodeRow.reported_gpus``/``reported_gpu_type``, and
    the node is drained (``_drain_for_inventory``; refused as before when QUARANTINED or
    FENCED); the next registration after the drain records them.

    Agent epochs: a restarted agent registers with a higher epoch (its state dir keeps a
    counter); the same epoch again is a retried registration. A *lower* epoch means the
    agent's state dir was wiped (a re-installed node): it is accepted, but the agent cannot
    know the attempts the database gave this node, so they are fenced at once (jobs re-placed,
    GPUs QUARANTINED until the fresh agent's first heartbeat lists none of them), and the node
    continues under the new epoch. Who may register as a node id is decided by its identity
    (certificates), not by the epoch."""
    if not inv.gpus:
        raise ValidationFailed("a node must have at least one GPU", field="gpus")
    forget_fleet_shapes()
    types = {g.gpu_type for g in inv.gpus}
    if len(types) != 1:
        raise ValidationFailed(
            f"mixed GPU types on one node are not supported: {types}", field="gpus"
        )
    now = db_now(session)
    gpu_type = types.pop()
    mem = min(g.memory_mb for g in inv.gpus)
    node = session.get(NodeRow, inv.node_id, with_for_update=True)
    # a new node: INSERT ... ON CONFLICT DO NOTHING, not a read and then an insert (two
    # registrations of one new node at once, e.g. a retried call while the first is still in
    # its transaction, both read "absent" and one insert failed with a unique violation):
    # the loser waits for the winner's commit and then refreshes the winner's row below
    if node is None and insert_if_absent(
        session,
        NodeRow.__table__,
        {
            "id": inv.node_id,
            "address": inv.address,
            "status": NodeStatus.HEALTHY,
            "gpu_type": gpu_type,
            "gpu_memory_mb": mem,
            "cpu": inv.cpu,
            "memory_mb": inv.memory_mb,
            "labels": inv.labels,
            "agent_epoch": inv.agent_epoch,
            "inventory_source": inv.inventory_source,
            "gpu_sharing": GpuSharing(inv.gpu_sharing).value,
            "registered_at": now,
            "last_heartbeat_at": now,
        },
    ):
        allocate.set_inventory(session, inv.node_id, inv.gpus)
        record_event(
            session,
            "node_registered",
            now=now,
            node_id=inv.node_id,
            message=f"{len(inv.gpus)}x{gpu_type} at {inv.address} ({inv.inventory_source})",
        )
        return
    if node is None:
        node = session.get(NodeRow, inv.node_id, with_for_update=True, populate_existing=True)
        assert node is not None  # the concurrent registration's row, committed
    if inv.agent_epoch < node.agent_epoch:
        fence_lost_agent_state(
            session,
            node,
            reason=(
                f"agent state lost (agent epoch {inv.agent_epoch} < known {node.agent_epoch}:"
                " re-installed or wiped state dir)"
            ),
            max_node_failures=max_node_failures,
        )
    try:
        allocate.set_inventory(session, inv.node_id, inv.gpus, retype=node.gpu_type != gpu_type)
        kept_inventory = None
    except Conflict as refused:  # GPUs are reserved
        if node.status not in KEEPS_INVENTORY:
            raise  # QUARANTINED, FENCED: refused until its GPUs are given back, as before
        kept_inventory = str(refused)
    node.address, node.labels, node.cpu, node.memory_mb = (
        inv.address,
        inv.labels,
        inv.cpu,
        inv.memory_mb,
    )
    if kept_inventory is None:
        node.gpu_type, node.gpu_memory_mb = gpu_type, mem
    node.agent_epoch, node.inventory_source, node.last_heartbeat_at = (
        inv.agent_epoch,
        inv.inventory_source,
        now,
    )
    node.gpu_sharing = GpuSharing(inv.gpu_sharing).value
    if kept_inventory is not None:
        _drain_for_inventory(
            session, node, kept_inventory, reported=(len(inv.gpus), gpu_type), now=now
        )
    elif not _end_inventory_drain(session, node, now) and node.status == NodeStatus.SUSPECT:
        back_to_healthy(
            session, node.id, frm=NodeStatus.SUSPECT, now=now, message="agent re-registered"
        )
    record_event(
        session,
        "node_registered",
        now=now,
        node_id=inv.node_id,
        message=f"re-registered, agent epoch {inv.agent_epoch}",
    )


KEEPS_INVENTORY = (
    NodeStatus.HEALTHY,
    NodeStatus.SUSPECT,
    NodeStatus.UNHEALTHY,
    NodeStatus.CORDONED,
    NodeStatus.DRAINING,
)
"""Statuses in which a re-registration reporting other GPUs while GPUs are reserved keeps the
recorded GPUs and drains the node; in the others (QUARANTINED, FENCED) it is refused."""


INVENTORY_DRAIN = "its agent's next start after the drain records the new GPUs"
"""The end of the reason of a node drained for a changed inventory, for people: the state is
``NodeRow.reported_gpus`` (set: the recorded GPUs are not the agent's, and the node may not be
uncordoned), and no code reads it out of the reason."""


_NO_REPORTED_INVENTORY: dict[str, object] = {"reported_gpus": None, "reported_gpu_type": None}


def _drain_for_inventory(
    session: Session, node: NodeRow, refused: str, *, reported: tuple[int, str], now: datetime
) -> None:
    """A re-registering agent reports another GPU count or type while GPUs of its node are
    reserved (a typo in ``--gpus``, a GPU fallen off the bus): the node keeps its recorded
    GPUs, so the running attempts keep their reservations and report their ends, records the
    ``reported`` ones (count, type) in ``reported_gpus``/``reported_gpu_type``, and goes
    DRAINING (Slurm drains a node whose resources shrink), an operator's reason kept in front.
    Once drained (CORDONED), the agent's next start records the new GPUs and lets the node be
    uncordoned (``_end_inventory_drain``); until then ``set_node_status`` refuses to uncordon
    it, since the scheduler would place jobs on GPUs the agent does not have."""
    # an earlier drain for the same reason (its words end the reason): say it once
    before = node.status_reason if node.reported_gpus is None else None
    why = f"{refused}; {INVENTORY_DRAIN}"
    if before and node.status in (NodeStatus.CORDONED, NodeStatus.DRAINING):
        why = f"{before}; {why}"
    pending = {"reported_gpus": reported[0], "reported_gpu_type": reported[1]}
    if node.status == NodeStatus.DRAINING:
        set_status_reason(session, node.id, why, **pending)
        return
    values = {"status_reason": why, **pending}
    transition(
        session,
        Machine.NODE,
        node.id,
        NodeStatus.DRAINING,
        now=now,
        frm=[node.status],
        values=values,
        message=why,
        node_id=node.id,
    )


def _end_inventory_drain(session: Session, node: NodeRow, now: datetime) -> bool:
    """The agent's GPUs are recorded (again): a drain started by ``_drain_for_inventory``
    ends (``reported_gpus`` cleared). Still DRAINING (the agent came back with its recorded
    GPUs before the drain finished): HEALTHY again. CORDONED (drained, now recorded): it stays
    cordoned, and its reason says it may be uncordoned. FENCED meanwhile (an operator's fence,
    a revoked certificate): it stays so, with that reason. True when the node was in such a
    drain."""
    if node.reported_gpus is None:
        return False
    if node.status == NodeStatus.DRAINING:
        transition(
            session,
            Machine.NODE,
            node.id,
            NodeStatus.HEALTHY,
            now=now,
            frm=[NodeStatus.DRAINING],
            values={"status_reason": None, **_NO_REPORTED_INVENTORY},
            message="its agent reports the recorded GPUs again: drain ended",
            node_id=node.id,
        )
        return True
    if node.status == NodeStatus.CORDONED:
        reason = "drained for a change of GPUs, now recorded: uncordon it to use them"
        set_status_reason(session, node.id, reason, **_NO_REPORTED_INVENTORY)
    else:  # (FENCED meanwhile: its fence reason stays)
        session.execute(
            update(NodeRow).where(NodeRow.id == node.id).values(**_NO_REPORTED_INVENTORY)
        )
    return True
