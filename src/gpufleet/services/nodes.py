"""Node registration and heartbeats (the agent's side of the protocol, control-plane half)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import bindparam, exists, func, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, NotFound, ValidationFailed
from gpufleet.domain.states import (
    RUN_ACTIVE,
    JobStatus,
    Machine,
    NodeStatus,
    ReservationStatus,
    RunStatus,
)
from gpufleet.domain.types import GpuDevice
from gpufleet.services import runs
from gpufleet.services.jobs import forget_fleet_shapes
from gpufleet.store import allocate, leader
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, NodeCapacityRow, NodeRow, ReservationRow
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


def fence_lost_agent_state(
    session: Session, node: NodeRow, *, reason: str, max_node_failures: int = 3
) -> None:
    """The node's agent lost its state (re-installed, wiped state dir, rejoined with a new
    certificate): it cannot know the attempts the database gave this node, so they are
    fenced at once (jobs re-placed with a higher token; GPUs QUARANTINED until the fresh
    agent's heartbeats list none of them, or an operator fences the node)."""
    has_active = session.execute(
        select(JobRunRow.id)
        .where(JobRunRow.node_id == node.id, JobRunRow.status.in_(sorted(RUN_ACTIVE)))
        .limit(1)
    ).first()
    fence_node(
        session,
        node.id,
        reason=reason,
        max_node_failures=max_node_failures,
        node_to=NodeStatus.QUARANTINED
        if has_active
        and node.status in (NodeStatus.HEALTHY, NodeStatus.SUSPECT, NodeStatus.UNHEALTHY)
        else None,
    )
    session.refresh(node)


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
    values = {
        "status_reason": why,
        "reported_gpus": reported[0],
        "reported_gpu_type": reported[1],
    }
    if node.status == NodeStatus.DRAINING:
        session.execute(update(NodeRow).where(NodeRow.id == node.id).values(**values))
        return
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
    values = dict(_NO_REPORTED_INVENTORY)
    if node.status == NodeStatus.CORDONED:
        values["status_reason"] = (
            "drained for a change of GPUs, now recorded: uncordon it to use them"
        )
    session.execute(update(NodeRow).where(NodeRow.id == node.id).values(**values))
    return True


def _pending_inventory(session: Session, node: NodeRow) -> str:
    """What the agent of a node with ``reported_gpus`` set reported, against what is recorded
    (for reasons and errors)."""
    cap = session.get(NodeCapacityRow, node.id)
    recorded = f"{cap.total_gpus} recorded" if cap is not None else "recorded"
    return (
        f"node {node.id} now reports {node.reported_gpus} {node.reported_gpu_type} GPU(s)"
        f" ({recorded})"
    )


def set_status_reason(session: Session, node_id: str, reason: str | None) -> None:
    """Change why a node is in its status without a transition (the status stays; a
    transition sets the reason with it through ``values``)."""
    session.execute(update(NodeRow).where(NodeRow.id == node_id).values(status_reason=reason))


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
    prepull: tuple[str, ...] = ()
    """Images the node should pull ahead of jobs (asked by ``prepull_images``; sent once)."""
    leader_epoch: int = 0
    """The current lease's epoch (the agent believes it; see ``agent.core``)."""


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """What the agent says about itself in a heartbeat."""

    health: str = "HEALTHY"
    """``HEALTHY`` or what is wrong (``node unhealthy: disk: ...``, ``UNKILLABLE: ...``)."""
    disk_free_mb: dict[str, int] | None = None
    recent_start_failures: int = 0


def heartbeat(
    session: Session,
    node_id: str,
    agent_epoch: int,
    running: list[HeartbeatRun],
    health: NodeHealth | None = None,
    images: list[dict[str, Any]] | None = None,
) -> HeartbeatVerdict:
    """Record liveness and health and compare the agent's running set with the database.

    A health other than ``HEALTHY`` makes a HEALTHY node UNHEALTHY (no placements; the
    reason is shown by ``why`` and ``gpufleet nodes``); ``HEALTHY`` again restores it.

    ``images``: the node's local container images (``name``, ``digest``, ``size_bytes``), or
    None when the agent did not report them (the stored list stays). Pending pre-pulls of the
    node are handed out once, in the verdict."""
    now = db_now(session)
    lease_epoch = leader.current_epoch(session)
    node = session.get(NodeRow, node_id)
    if node is None:
        return HeartbeatVerdict(known=False, leader_epoch=lease_epoch)
    if agent_epoch < node.agent_epoch:  # a stale agent process; its successor speaks
        return HeartbeatVerdict(known=True, leader_epoch=lease_epoch)
    values: dict[str, object] = {"last_heartbeat_at": now}
    if images is not None and images != (node.images or []):
        values["images"] = images
    prepull = tuple(node.prepull or ())
    if prepull:
        values["prepull"] = None
    if health is not None:
        values["health"] = {
            "health": health.health,
            "disk_free_mb": dict(health.disk_free_mb or {}),
            "recent_start_failures": health.recent_start_failures,
            # what the agent knows, for the invariant checker's "stuck" checks
            "runs": sorted(h.run_id for h in running),
        }
    session.execute(update(NodeRow).where(NodeRow.id == node_id).values(**values))
    # fenced runs the agent no longer lists are gone (it kills a fenced run it still has,
    # through the stop list below, before it stops listing it): their GPUs come back
    release_gone_quarantined(
        session,
        node_id,
        {h.run_id for h in running},
        message="the agent reports the fenced run gone",
    )
    if node.status == NodeStatus.SUSPECT:
        back_to_healthy(
            session, node_id, frm=NodeStatus.SUSPECT, now=now, message="heartbeat resumed"
        )
    if health is not None:
        apply_health(session, node_id, health.health, now=now)
    if not running:
        return HeartbeatVerdict(known=True, prepull=prepull, leader_epoch=lease_epoch)
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
        authoritative = (run.id == current or run.gang_size > 1) and run.token == h.token == epoch
        if run.node_id != node_id or not authoritative or run.status not in RUN_ACTIVE:
            if h.state != "EXITED":
                stop.append(h)
        elif run.status == RunStatus.ASSIGNED and h.state == "RUNNING":
            confirm.append(h)
    return HeartbeatVerdict(
        known=True,
        stop=tuple(stop),
        confirm=tuple(confirm),
        prepull=prepull,
        leader_epoch=lease_epoch,
    )


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


def set_node_status(
    session: Session, node_id: str, to: NodeStatus, *, message: str, reason: str | None = None
) -> str:
    """Operator actions (cordon, drain, uncordon...). ``reason`` is kept on the node (shown
    by ``gpufleet nodes`` and ``why``); HEALTHY clears it. Returns the previous status.

    Raises:
        NotFound: no such node.
        IllegalTransition: the node's status has no edge to ``to`` (e.g. QUARANTINED ->
            DRAINING: its GPUs are not known free; fence it or wait for its agent).
        Conflict: uncordon (``to`` HEALTHY) of a node drained for a change of GPUs that its
            agent has not registered since (``NodeRow.reported_gpus`` set).
    """
    node = session.get(NodeRow, node_id)
    if node is None:
        raise NotFound(f"no node {node_id!r}", field="node_id")
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
    """A HEALTHY or UNHEALTHY node with no heartbeat since ``cutoff`` (a datetime or a bind
    parameter): what :func:`mark_silent_nodes_suspect` moves to SUSPECT."""
    return NodeRow.status.in_([NodeStatus.HEALTHY, NodeStatus.UNHEALTHY]) & (
        NodeRow.last_heartbeat_at < cutoff
    )


def _silent_fenceable(cutoff: Any) -> Any:
    """A SUSPECT, CORDONED or DRAINING node with no heartbeat since ``cutoff``: what
    :func:`fence_silent_nodes` fences."""
    return NodeRow.status.in_([NodeStatus.SUSPECT, NodeStatus.CORDONED, NodeStatus.DRAINING]) & (
        NodeRow.last_heartbeat_at < cutoff
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
            values={"status_reason": f"no heartbeat for {silent_for_s:.0f} s"},
            message=f"no heartbeat for {silent_for_s:.0f} s",
            node_id=node_id,
        )
    return ids


# ---------------------------------------------------------------------- fencing (seed DD3)


@dataclass(frozen=True, slots=True)
class Fenced:
    """One attempt fenced: its job's next status (None: the job had already moved on)."""

    run_id: str
    job_id: str
    job_status: str | None


def fence_node(
    session: Session,
    node_id: str,
    *,
    reason: str,
    max_node_failures: int,
    node_to: NodeStatus | None = None,
    leader_holder: str | None = None,
    leader_epoch: int | None = None,
) -> list[Fenced]:
    """Fence every active attempt of ``node_id`` in this one transaction.

    Each attempt -> FENCED (its token is revoked: the job moves on, and a report or confirm
    under that token is STALE), its reservation -> QUARANTINED (the GPUs are not offered
    again until the agent reports the run gone or an operator confirms the node dead), and
    its job: CANCELLED if a cancel was asked, PENDING if it was being preempted, FAILED if it
    was being stopped for its max runtime, else PENDING for a new attempt elsewhere while it
    has lost at most ``max_node_failures`` attempts to nodes (node losses never consume
    ``max_retries``), FAILED after that. The team is charged the GPU-time up to now.

    Args:
        node_to: the node's new status (e.g. QUARANTINED), or None to leave it.
        leader_holder, leader_epoch: when given, checked against the lease in this
            transaction (the failure detector); an operator's fence passes None.

    Raises:
        NotLeader: the lease moved on.
        NotFound: no such node.
    """
    now = db_now(session)
    if leader_holder is not None and leader_epoch is not None:
        leader.assert_leader(session, leader_holder, leader_epoch, now)
    node = session.get(NodeRow, node_id, with_for_update=True)
    if node is None:
        raise NotFound(f"no node {node_id!r}", field="node_id")
    out: list[Fenced] = []
    active = session.scalars(
        select(JobRunRow)
        .where(JobRunRow.node_id == node_id, JobRunRow.status.in_(sorted(RUN_ACTIVE)))
        .order_by(JobRunRow.id)
    ).all()
    for run in active:
        job = session.get(JobRow, run.job_id, with_for_update=True)
        assert job is not None
        transition(
            session,
            Machine.RUN,
            run.id,
            RunStatus.FENCED,
            now=now,
            frm=[run.status],
            guard={"token": run.token},
            values={"finished_at": now, "message": f"fenced: {reason}", "charged_to": "node"},
            job_id=job.id,
            run_id=run.id,
            node_id=node_id,
            message=reason,
        )
        res = session.execute(
            select(ReservationRow).where(ReservationRow.run_id == run.id).with_for_update()
        ).scalar_one_or_none()
        if res is not None and res.status in (
            ReservationStatus.RESERVED,
            ReservationStatus.CONFIRMED,
        ):
            transition(
                session,
                Machine.RESERVATION,
                res.id,
                ReservationStatus.QUARANTINED,
                now=now,
                frm=[res.status],
                job_id=job.id,
                run_id=run.id,
                node_id=node_id,
                message=reason,
            )
            runs.charge_usage(
                session, job.team_id, res.gpu_count, reserved_at=run.created_at, released_at=now
            )
        current = runs.is_current(job, run)
        job_to = _job_after_fence(session, job, run, max_node_failures) if current else None
        if job_to is not None and run.gang_size > 1:
            # a gang member: the attempt's other members are stopped (verified) first; the
            # job moves when the last of them ends (runs.finish_gang_if_done)
            cause = runs.gang_cause(session, run, job_to[0])
            if cause:
                session.execute(update(JobRunRow).where(JobRunRow.id == run.id).values(**cause))
            runs.stop_gang(
                session,
                job.id,
                run.token,
                cause_run_id=run.id,
                message=f"rank {run.rank}'s node was fenced ({reason}); stopping the gang",
            )
            runs.finish_gang_if_done(session, job, run.token, now)
            session.refresh(job)
            out.append(Fenced(run.id, job.id, JobStatus(job.status)))
            continue
        if job_to is not None:
            to, why = job_to
            values: dict[str, object] = {"pending_reason": None}
            if to != JobStatus.PENDING:
                values.update(finished_at=now, failure_reason=None if to == "CANCELLED" else why)
            transition(
                session,
                Machine.JOB,
                job.id,
                to,
                now=now,
                frm=[job.status],
                guard={"fencing_epoch": run.token},
                values=values,
                job_id=job.id,
                run_id=run.id,
                node_id=node_id,
                message=why,
            )
        out.append(Fenced(run.id, job.id, job_to[0] if job_to else None))
    if node_to is not None and node.status != node_to:
        transition(
            session,
            Machine.NODE,
            node_id,
            node_to,
            now=now,
            frm=[node.status],
            values={"status_reason": reason},
            node_id=node_id,
            message=f"{reason}; {len(out)} attempt(s) fenced",
        )
    record_event(
        session,
        "fence",
        now=now,
        node_id=node_id,
        message=f"{reason}: fenced {len(out)} attempt(s)",
        details={"runs": [f.run_id for f in out]},
    )
    return out


def _job_after_fence(
    session: Session, job: JobRow, run: JobRunRow, max_node_failures: int
) -> tuple[JobStatus, str] | None:
    if job.status not in (JobStatus.SCHEDULED, JobStatus.RUNNING):
        return None
    if run.stop_reason == "cancel" or job.cancel_requested:
        return JobStatus.CANCELLED, "cancelled; its node was fenced"
    if run.stop_reason in ("preempt", "requeue"):
        what = "preempted" if run.stop_reason == "preempt" else "requeue requested"
        return JobStatus.PENDING, f"{what}; its node was fenced; requeued"
    if run.stop_reason == "timeout":
        return JobStatus.FAILED, "TIMEOUT: ran past max_runtime_s (its node was then fenced)"
    session.flush()
    lost = session.execute(
        select(func.count())
        .select_from(JobRunRow)
        .where(JobRunRow.job_id == job.id, JobRunRow.charged_to == "node")
    ).scalar_one()
    if lost <= max_node_failures:
        return JobStatus.PENDING, (
            f"its node {run.node_id} was lost ({lost} of {max_node_failures} node losses);"
            " requeued for a new attempt elsewhere (no user retry used)"
        )
    return JobStatus.FAILED, f"lost {lost} attempts to failed nodes (max_node_failures)"


def release_gone_quarantined(
    session: Session, node_id: str, still_known: set[str] | None, *, message: str
) -> int:
    """Release the QUARANTINED reservations of ``node_id`` whose runs the agent does not list
    (``still_known``; None = release all: an operator confirmed the node dead, -> EXPIRED).
    A QUARANTINED node with none left becomes HEALTHY. Returns the GPUs returned."""
    now = db_now(session)
    held = session.scalars(
        select(ReservationRow.run_id).where(
            ReservationRow.node_id == node_id,
            ReservationRow.status == ReservationStatus.QUARANTINED,
        )
    ).all()
    back = 0
    left = 0
    for run_id in held:
        if still_known is not None and run_id in still_known:
            left += 1
            continue
        back += allocate.release(
            session,
            run_id=run_id,
            now=now,
            to=ReservationStatus.EXPIRED if still_known is None else ReservationStatus.RELEASED,
            message=message,
            only_quarantined=True,
        )
    if still_known is not None and left == 0:
        node = session.get(NodeRow, node_id)
        if node is not None and node.status == NodeStatus.QUARANTINED:
            back_to_healthy(
                session,
                node_id,
                frm=NodeStatus.QUARANTINED,
                now=now,
                message="the agent is back and its fenced runs are gone",
            )
    return back


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


def operator_fence(
    session: Session, node_id: str, *, reason: str, max_node_failures: int
) -> tuple[list[Fenced], int]:
    """``gpufleet admin node fence NODE --confirm-dead``: the operator vouches that the node
    is dead (powered off, re-installed). Its remaining attempts are fenced, every QUARANTINED
    reservation of it is EXPIRED (its GPUs offered again) and the node is FENCED (no
    placements until ``admin node uncordon``). Returns (attempts fenced, GPUs returned).

    Raises:
        NotFound: no such node.
    """
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
