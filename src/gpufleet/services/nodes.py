"""Node registration and heartbeats (the agent's side of the protocol, control-plane half)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, NotFound, ValidationFailed
from gpufleet.domain.states import RUN_ACTIVE, Machine, NodeStatus, RunStatus
from gpufleet.domain.types import GpuDevice
from gpufleet.services.jobs import forget_fleet_shapes
from gpufleet.store import allocate, leader
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow
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


def register_node(session: Session, inv: NodeInventory) -> None:
    """Insert or refresh a node. A re-registration may change address, labels and epoch;
    a changed GPU count is refused while GPUs are reserved (an operator must drain first)."""
    if not inv.gpus:
        raise ValidationFailed("a node must have at least one GPU", field="gpus")
    forget_fleet_shapes()
    types = {g.gpu_type for g in inv.gpus}
    if len(types) != 1:
        raise ValidationFailed(
            f"mixed GPU types on one node are not supported: {types}", field="gpus"
        )
    now = db_now(session)
    node = session.get(NodeRow, inv.node_id, with_for_update=True)
    gpu_type = types.pop()
    mem = min(g.memory_mb for g in inv.gpus)
    if node is None:
        session.add(
            NodeRow(
                id=inv.node_id,
                address=inv.address,
                status=NodeStatus.HEALTHY,
                gpu_type=gpu_type,
                gpu_memory_mb=mem,
                cpu=inv.cpu,
                memory_mb=inv.memory_mb,
                labels=inv.labels,
                agent_epoch=inv.agent_epoch,
                inventory_source=inv.inventory_source,
                registered_at=now,
                last_heartbeat_at=now,
            )
        )
        session.flush()
        allocate.set_inventory(session, inv.node_id, inv.gpus)
        record_event(
            session,
            "node_registered",
            now=now,
            node_id=inv.node_id,
            message=f"{len(inv.gpus)}x{gpu_type} at {inv.address} ({inv.inventory_source})",
        )
        return
    if inv.agent_epoch < node.agent_epoch:
        raise Conflict(
            f"agent epoch {inv.agent_epoch} < known {node.agent_epoch}", field="agent_epoch"
        )
    allocate.set_inventory(session, inv.node_id, inv.gpus)
    node.address, node.labels, node.cpu, node.memory_mb = (
        inv.address,
        inv.labels,
        inv.cpu,
        inv.memory_mb,
    )
    node.gpu_type, node.gpu_memory_mb = gpu_type, mem
    node.agent_epoch, node.inventory_source, node.last_heartbeat_at = (
        inv.agent_epoch,
        inv.inventory_source,
        now,
    )
    if node.status == NodeStatus.SUSPECT:
        transition(
            session,
            Machine.NODE,
            node.id,
            NodeStatus.HEALTHY,
            now=now,
            frm=[NodeStatus.SUSPECT],
            message="agent re-registered",
            node_id=node.id,
        )
    record_event(
        session,
        "node_registered",
        now=now,
        node_id=inv.node_id,
        message=f"re-registered, agent epoch {inv.agent_epoch}",
    )


@dataclass(frozen=True, slots=True)
class HeartbeatRun:
    run_id: str
    job_id: str
    token: int
    state: str


@dataclass(frozen=True, slots=True)
class HeartbeatVerdict:
    known: bool
    """False: the node is not registered (the agent should register again)."""
    stop: tuple[HeartbeatRun, ...] = ()
    """Runs the agent must stop: unknown, stale token, or terminal in the database."""
    confirm: tuple[HeartbeatRun, ...] = ()
    """Runs the agent runs whose confirmation was lost: confirm them (lost ack != lost work)."""
    leader_epoch: int = 0
    """The current lease's epoch (the agent believes it; see ``agent.core``)."""


def heartbeat(
    session: Session, node_id: str, agent_epoch: int, running: list[HeartbeatRun]
) -> HeartbeatVerdict:
    """Record liveness and compare the agent's running set with the database."""
    now = db_now(session)
    epoch = leader.current_epoch(session)
    node = session.get(NodeRow, node_id)
    if node is None:
        return HeartbeatVerdict(known=False, leader_epoch=epoch)
    if agent_epoch < node.agent_epoch:  # a stale agent process; its successor speaks
        return HeartbeatVerdict(known=True, leader_epoch=epoch)
    session.execute(update(NodeRow).where(NodeRow.id == node_id).values(last_heartbeat_at=now))
    if node.status == NodeStatus.SUSPECT:
        transition(
            session,
            Machine.NODE,
            node_id,
            NodeStatus.HEALTHY,
            now=now,
            frm=[NodeStatus.SUSPECT],
            message="heartbeat resumed",
            node_id=node_id,
        )
    if not running:
        return HeartbeatVerdict(known=True, leader_epoch=epoch)
    rows = {
        r.id: (r, cur, epoch)
        for r, cur, epoch in session.execute(
            select(JobRunRow, JobRow.current_run_id, JobRow.fencing_epoch)
            .join(JobRow, JobRow.id == JobRunRow.job_id)
            .where(JobRunRow.id.in_([h.run_id for h in running]))
        )
    }
    stop, confirm = [], []
    for h in running:
        found = rows.get(h.run_id)
        if found is None:
            stop.append(h)
            continue
        run, current, epoch = found
        authoritative = run.id == current and run.token == h.token == epoch
        if run.node_id != node_id or not authoritative or run.status not in RUN_ACTIVE:
            if h.state != "EXITED":
                stop.append(h)
        elif run.status == RunStatus.ASSIGNED and h.state == "RUNNING":
            confirm.append(h)
    return HeartbeatVerdict(
        known=True, stop=tuple(stop), confirm=tuple(confirm), leader_epoch=epoch
    )


def set_node_status(session: Session, node_id: str, to: NodeStatus, *, message: str) -> str:
    """Operator actions (cordon, drain, uncordon, fence...). Returns the previous status."""
    node = session.get(NodeRow, node_id)
    if node is None:
        raise NotFound(f"no node {node_id!r}", field="node_id")
    return transition(
        session,
        Machine.NODE,
        node_id,
        to,
        now=db_now(session),
        frm=[node.status],
        message=message,
        node_id=node_id,
    )


def mark_silent_nodes_suspect(session: Session, silent_for_s: float) -> list[str]:
    """HEALTHY nodes with no heartbeat for ``silent_for_s`` -> SUSPECT (no placements there;
    nothing is released: silence is a question, not an answer). Returns their ids."""
    now = db_now(session)
    from datetime import timedelta

    cutoff: datetime = now - timedelta(seconds=silent_for_s)
    ids = list(
        session.scalars(
            select(NodeRow.id).where(
                NodeRow.status == NodeStatus.HEALTHY, NodeRow.last_heartbeat_at < cutoff
            )
        )
    )
    for node_id in ids:
        transition(
            session,
            Machine.NODE,
            node_id,
            NodeStatus.SUSPECT,
            now=now,
            frm=[NodeStatus.HEALTHY],
            message=f"no heartbeat for {silent_for_s:.0f} s",
            node_id=node_id,
        )
    return ids
