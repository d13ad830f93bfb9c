"""Reads: rows -> the policy's snapshot, and rows -> the invariant checker's view."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.domain.invariants import (
    InvariantView,
    JobView,
    NodeView,
    ReservationView,
    RunView,
    Violation,
    check_invariants,
)
from gpufleet.domain.states import JobStatus, NodeStatus, ReservationStatus, RunStatus
from gpufleet.domain.types import PriorityClass, Resources
from gpufleet.policy.snapshot import (
    BackfillReservation,
    ClusterSnapshot,
    GpuHold,
    NodeState,
    PendingJob,
    RunningJob,
    TeamState,
)
from gpufleet.policy.usage import UsageLedger
from gpufleet.store.db import Database
from gpufleet.store.tables import (
    GpuHoldRow,
    JobRow,
    JobRunRow,
    NodeCapacityRow,
    NodeGpuRow,
    NodeRow,
    ReservationRow,
    TeamRow,
)


def resources_of(spec: dict[str, object]) -> Resources:
    """The Resources of a stored job spec (see services.jobs.normalize_spec)."""
    r = spec["resources"]
    assert isinstance(r, dict)
    return Resources(
        gpu_count=int(r["gpu_count"]),
        gpu_types=tuple(r.get("gpu_types") or ()),
        gpu_memory_mb=int(r.get("gpu_memory_mb") or 0),
        cpu=float(r.get("cpu") or 0.0),
        memory_mb=int(r.get("memory_mb") or 0),
    )


def load_snapshot(
    session: Session,
    now: datetime,
    *,
    reservations: tuple[BackfillReservation, ...] = (),
    usage_half_life_s: float = 7 * 24 * 3600.0,
) -> ClusterSnapshot:
    """Everything one scheduling pass needs, in a handful of indexed queries (call inside
    ``Database.snapshot()`` so that they all see one moment).

    Args:
        reservations: the backfill reservations of the previous pass (kept by the leader).
        usage_half_life_s: decay of charged usage (``policy.usage``).
    """
    now_s = now.timestamp()
    nodes = []
    rows = session.execute(
        select(NodeRow, NodeCapacityRow).join(
            NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id
        )
    ).all()
    for node, cap in rows:
        nodes.append(
            NodeState(
                node_id=node.id,
                gpu_type=node.gpu_type,
                gpu_memory_mb=node.gpu_memory_mb,
                total_gpus=cap.total_gpus,
                free_gpus=cap.available_gpus,
                cpu_total=node.cpu,
                cpu_free=node.cpu,
                memory_total_mb=node.memory_mb,
                memory_free_mb=node.memory_mb,
                labels=dict(node.labels or {}),
                schedulable=node.status == NodeStatus.HEALTHY,
                status=node.status,
            )
        )
    pending = []
    for job in session.scalars(
        select(JobRow).where(
            JobRow.status == JobStatus.PENDING, JobRow.cancel_requested.is_(False)
        )
    ):
        spec = job.spec
        pending.append(
            PendingJob(
                job_id=job.id,
                team_id=job.team_id,
                priority=PriorityClass(job.priority),
                submitted_at_s=job.created_at.timestamp(),
                resources=resources_of(spec),
                expected_duration_s=spec.get("expected_duration_s"),
                max_runtime_s=spec.get("max_runtime_s"),
                node_selector=dict(spec.get("node_selector") or {}),
                preemptible=bool(spec.get("preemptible", True)),
                attempt=job.attempts,
                queued_at_s=job.queued_at.timestamp(),
            )
        )
    gpu_type_of = {n.node_id: n.gpu_type for n in nodes}
    running = []
    for run, job in session.execute(
        select(JobRunRow, JobRow)
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .where(JobRunRow.status.in_([RunStatus.ASSIGNED, RunStatus.RUNNING, RunStatus.PREEMPTING]))
    ):
        spec = job.spec
        res = resources_of(spec)
        running.append(
            RunningJob(
                run_id=run.id,
                job_id=job.id,
                team_id=job.team_id,
                node_id=run.node_id,
                priority=PriorityClass(job.priority),
                gpu_count=len(run.gpu_ids),
                gpu_type=gpu_type_of.get(run.node_id, ""),
                started_at_s=(run.started_at or run.created_at).timestamp(),
                cpu=res.cpu,
                memory_mb=res.memory_mb,
                expected_duration_s=spec.get("expected_duration_s"),
                max_runtime_s=spec.get("max_runtime_s"),
                preemptible=bool(spec.get("preemptible", True)),
                stopping=run.status == RunStatus.PREEMPTING,
                stopping_for_job_id=run.preempted_for_job_id,
            )
        )
    running_by_team: dict[str, list[tuple[int, float]]] = {}
    reserved_at = dict(
        session.execute(
            select(ReservationRow.run_id, ReservationRow.created_at).where(
                ReservationRow.status.in_(
                    [ReservationStatus.RESERVED, ReservationStatus.CONFIRMED]
                )
            )
        ).all()
    )
    for r in running:
        since = reserved_at.get(r.run_id)
        start_s = since.timestamp() if since is not None else r.started_at_s
        running_by_team.setdefault(r.team_id, []).append((r.gpu_count, start_s))
    teams = {}
    for t in session.scalars(select(TeamRow)):
        as_of = (t.usage_as_of or now).timestamp()
        ledger = UsageLedger(t.usage_gpu_s, min(as_of, now_s), usage_half_life_s)
        teams[t.id] = TeamState(
            team_id=t.id,
            weight=t.weight,
            guaranteed_gpus=dict(t.guaranteed_gpus or {}),
            borrow_limit_gpus=t.borrow_limit_gpus,
            lending_limit_gpus=dict(t.lending_limit_gpus or {}),
            usage_gpu_s=ledger.with_running(now_s, running_by_team.get(t.id, [])),
        )
    holds = tuple(
        GpuHold(h.job_id, h.node_id, h.gpu_count, h.since.timestamp(), h.reason)
        for h in session.scalars(select(GpuHoldRow).order_by(GpuHoldRow.job_id))
    )
    return ClusterSnapshot(
        now_s=now_s,
        nodes=tuple(nodes),
        pending=tuple(pending),
        running=tuple(running),
        teams=teams,
        holds=holds,
        reservations=reservations,
    )


def load_invariant_view(session: Session) -> InvariantView:
    """The whole allocation state, read in one transaction, for ``check_invariants``."""
    holders: dict[str, dict[int, str | None]] = {}
    for g in session.scalars(select(NodeGpuRow)):
        holders.setdefault(g.node_id, {})[g.gpu_index] = g.holder_run_id
    nodes = tuple(
        NodeView(c.node_id, c.total_gpus, c.available_gpus, holders.get(c.node_id, {}))
        for c in session.scalars(select(NodeCapacityRow))
    )
    reservations = tuple(
        ReservationView(r.id, r.run_id, r.job_id, r.node_id, tuple(r.gpu_ids), r.status)
        for r in session.scalars(
            select(ReservationRow).where(
                ReservationRow.status.in_(
                    [ReservationStatus.RESERVED, ReservationStatus.CONFIRMED]
                )
            )
        )
    )
    jobs = tuple(
        JobView(j.id, j.status, j.current_run_id, j.fencing_epoch)
        for j in session.scalars(select(JobRow))
    )
    runs = tuple(
        RunView(r.id, r.job_id, r.status, r.token, r.status == RunStatus.SUCCEEDED)
        for r in session.scalars(select(JobRunRow))
    )
    return InvariantView(nodes, reservations, jobs, runs)


def check_database(db: Database) -> tuple[InvariantView, list[Violation]]:
    """Read the allocation state in one consistent snapshot and check invariants 1-4."""
    with db.snapshot() as session:
        view = load_invariant_view(session)
    return view, check_invariants(view)
