"""Heartbeats (the agent's side of the protocol, control-plane half): liveness and health
recorded, the agent's running set compared with the database.

The verdict tells the agent which runs to stop (unknown, stale token, ended) and which to
confirm (a lost confirmation), hands out the node's pending image pre-pulls once, and carries
the lease's epoch. The newest checkpoint time an agent reports for an authoritative attempt
is recorded as ``job_runs.last_checkpoint_at`` (the work a preemption would lose). Fenced
runs the agent no longer lists give their GPUs back (``node_fence.release_gone_quarantined``);
a SUSPECT node heard from is HEALTHY again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.states import RUN_ACTIVE, NodeStatus, RunStatus
from gpufleet.services.node_fence import release_gone_quarantined
from gpufleet.services.node_health import apply_health, back_to_healthy
from gpufleet.store import leader
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow

CHECKPOINT_CLOCK_SKEW_S = 60.0
"""How far ahead of the database clock a reported checkpoint time may be, seconds: the
agent's clock may run ahead of the database's by this much (the time is taken as the database
clock's now). A time further ahead is ignored: that clock, or a file time the job set, is not
to be believed."""


@dataclass(frozen=True, slots=True)
class HeartbeatRun:
    run_id: str
    job_id: str
    token: int
    state: str
    last_checkpoint_unix: float = 0.0
    """The newest file time in the attempt's checkpoint directory, the agent's wall clock,
    unix seconds; 0 = none or unknown."""


@dataclass(frozen=True, slots=True)
class HeartbeatVerdict:
    known: bool
    """False: the node is not registered (the agent should register again)."""
    stop: tuple[HeartbeatRun, ...] = ()
    """Runs the agent must stop: unknown, stale token, or terminal in the database; and
    fenced runs it no longer lists (their GPUs released now; the stop tombstones them)."""
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
    if images is not None:
        # older agents listed a podman image once per tag: keep each name once, in order
        unique: dict[str, dict[str, Any]] = {}
        for image in images:
            unique.setdefault(str(image.get("name", "")), image)
        images = list(unique.values())
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
    # through the stop list below, before it stops listing it): their GPUs come back, and
    # the agent is told to stop them too, which tombstones a run it never had: a late copy
    # of its AssignJob (sent before the fence, held in a frozen node's socket buffer) is then
    # refused as stale rather than starting the fenced attempt's code
    listed = {h.run_id for h in running}
    released: list[tuple[str, str, int]] = []
    release_gone_quarantined(
        session,
        node_id,
        listed,
        message="the agent reports the fenced run gone",
        released=released,
    )
    gone = [HeartbeatRun(r, j, t, state="GONE") for r, j, t in released]
    if node.status == NodeStatus.SUSPECT:
        back_to_healthy(
            session, node_id, frm=NodeStatus.SUSPECT, now=now, message="heartbeat resumed"
        )
    if health is not None:
        apply_health(session, node_id, health.health, now=now)
    if not running:
        return HeartbeatVerdict(
            known=True, stop=tuple(gone), prepull=prepull, leader_epoch=lease_epoch
        )
    rows = {
        r.id: (r, cur, epoch)
        for r, cur, epoch in session.execute(
            select(JobRunRow, JobRow.current_run_id, JobRow.fencing_epoch)
            .join(JobRow, JobRow.id == JobRunRow.job_id)
            .where(JobRunRow.id.in_([h.run_id for h in running]))
        )
    }
    stop, confirm = list(gone), []
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
        else:
            _note_checkpoint(session, run, h, now)
            if run.status == RunStatus.ASSIGNED and h.state == "RUNNING":
                confirm.append(h)
    return HeartbeatVerdict(
        known=True,
        stop=tuple(stop),
        confirm=tuple(confirm),
        prepull=prepull,
        leader_epoch=lease_epoch,
    )


def _note_checkpoint(session: Session, run: JobRunRow, h: HeartbeatRun, now: datetime) -> None:
    """Record the checkpoint time the agent reports for ``run``, the authoritative attempt on
    this node (its token is the job's current one; a stale agent's report never gets here).

    Up to :data:`CHECKPOINT_CLOCK_SKEW_S` ahead of ``now`` (the database clock) is taken as
    ``now``; further ahead is ignored. The stored time only moves forward: a report older
    than it (an agent restarted with a slower clock, a file removed) changes nothing."""
    if h.last_checkpoint_unix <= 0:
        return
    try:
        at = datetime.fromtimestamp(h.last_checkpoint_unix, UTC)
    except (OverflowError, OSError, ValueError):  # not a time (inf, nan, out of range)
        return
    if at > now + timedelta(seconds=CHECKPOINT_CLOCK_SKEW_S):
        return
    at = min(at, now)
    if run.last_checkpoint_at is not None and at <= run.last_checkpoint_at:
        return
    session.execute(
        update(JobRunRow)
        .where(
            JobRunRow.id == run.id,
            JobRunRow.token == h.token,
            or_(JobRunRow.last_checkpoint_at.is_(None), JobRunRow.last_checkpoint_at < at),
        )
        .values(last_checkpoint_at=at)
    )
