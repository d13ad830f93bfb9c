"""Reads: rows -> the policy's snapshot, and rows -> the invariant checker's view."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from gpufleet.domain.images import normalize_image
from gpufleet.domain.invariants import (
    InvariantView,
    JobView,
    NodeView,
    ReservationView,
    RunView,
    StuckLimits,
    Violation,
    check_invariants,
)
from gpufleet.domain.labels import effective_labels
from gpufleet.domain.states import (
    RESERVATION_ACTIVE,
    JobStatus,
    NodeStatus,
    ReservationStatus,
    RunStatus,
)
from gpufleet.domain.types import PriorityClass, Resources
from gpufleet.policy.snapshot import (
    BackfillReservation,
    ClusterSnapshot,
    Displacement,
    GpuHold,
    NodeState,
    PendingJob,
    RunningJob,
    TeamState,
)
from gpufleet.policy.usage import UsageLedger
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.predictions import HistoryPredictor
from gpufleet.store.tables import (
    GpuHoldRow,
    JobRow,
    JobRunRow,
    NodeCapacityRow,
    NodeGpuRow,
    NodeRow,
    ReservationRow,
    SchedulingEventRow,
    TeamRow,
)


def resources_of(spec: dict[str, object]) -> Resources:
    """The Resources of a stored job spec (written by services.job_submit.spec_to_dict)."""
    r = spec["resources"]
    assert isinstance(r, dict)
    return Resources(
        gpu_count=int(r["gpu_count"]),
        gpu_types=tuple(r.get("gpu_types") or ()),
        gpu_memory_mb=int(r.get("gpu_memory_mb") or 0),
        cpu=float(r.get("cpu") or 0.0),
        memory_mb=int(r.get("memory_mb") or 0),
        nodes=int(r["nodes"]) if r.get("nodes") else None,
        gpus_per_node=int(r["gpus_per_node"]) if r.get("gpus_per_node") else None,
        allow_partial_nodes=bool(r.get("allow_partial_nodes") or False),
        gpu_fraction=float(f) if (f := r.get("gpu_fraction")) is not None else None,
    )


@dataclass(frozen=True, slots=True)
class SpecFacts:
    """What the policy needs from a job's immutable spec."""

    resources: Resources
    expected_duration_s: float | None
    max_runtime_s: float | None
    node_selector: Mapping[str, str]
    preemptible: bool
    image: str | None = None


def spec_facts(spec: dict[str, Any]) -> SpecFacts:
    """The SpecFacts of a stored job spec."""
    return SpecFacts(
        resources=resources_of(spec),
        expected_duration_s=spec.get("expected_duration_s"),
        max_runtime_s=spec.get("max_runtime_s"),
        node_selector=dict(spec.get("node_selector") or {}),
        preemptible=bool(spec.get("preemptible", True)),
        image=normalize_image(spec.get("image") or "") or None,
    )


def node_state(n: Any, fence_after_s: float | None = None) -> NodeState:
    """The policy's view of a node row joined with its capacity (``load_snapshot`` and the
    leader's ``store.snapshot_cache``). ``fence_after_s``: the failure detector's silence
    before a fence (``max(fence_timeout_s, heartbeats to SUSPECT)``, seconds), which dates
    a SUSPECT node's ``fence_at_s`` from its last heartbeat (None: not dated)."""
    beat = getattr(n, "last_heartbeat_at", None)
    silent_since_s = (
        beat.timestamp() if beat is not None and n.status == NodeStatus.SUSPECT else None
    )
    fence_at_s = (
        silent_since_s + fence_after_s
        if silent_since_s is not None and fence_after_s is not None
        else None
    )
    return NodeState(
        node_id=n.id,
        gpu_type=n.gpu_type,
        gpu_memory_mb=n.gpu_memory_mb,
        total_gpus=n.total_gpus,
        free_gpus=n.available_gpus,
        cpu_total=n.cpu,
        cpu_free=n.cpu,
        memory_total_mb=n.memory_mb,
        memory_free_mb=n.memory_mb,
        labels=effective_labels(n.labels, n.admin_labels),
        schedulable=n.status == NodeStatus.HEALTHY,
        status=n.status,
        images=frozenset(normalize_image(str(i.get("name", ""))) for i in n.images or ()),
        silent_since_s=silent_since_s,
        fence_at_s=fence_at_s,
        gpu_sharing=getattr(n, "gpu_sharing", None) or "none",
    )


def pending_job(
    row: Any,
    facts: SpecFacts,
    predicted_s: float | None = None,
    avoid_node_id: str | None = None,
) -> PendingJob:
    """The policy's view of a PENDING job row (columns of ``_PENDING``-style selects);
    ``avoid_node_id``: from :func:`failed_start_nodes`."""
    return PendingJob(
        job_id=row.id,
        team_id=row.team_id,
        priority=PriorityClass(row.priority),
        submitted_at_s=row.created_at.timestamp(),
        resources=facts.resources,
        expected_duration_s=facts.expected_duration_s,
        max_runtime_s=row.max_runtime_s,
        node_selector=facts.node_selector,
        preemptible=facts.preemptible,
        attempt=row.attempts,
        queued_at_s=row.queued_at.timestamp(),
        image=facts.image,
        predicted_duration_s=predicted_s,
        avoid_node_id=avoid_node_id,
    )


def failed_start_nodes(session: Session, rows: Iterable[Any]) -> dict[str, str]:
    """Job id -> the node its current attempt FAILED on without ever starting, for the rows
    (of a pending select: ``id``, ``attempts``) of jobs that had an attempt: what
    ``PendingJob.avoid_node_id`` carries. One query per :data:`SpecCache.CHUNK` such jobs;
    none when no job has had an attempt (most passes of a fresh queue)."""
    ids = [r.id for r in rows if r.attempts]
    out: dict[str, str] = {}
    for start in range(0, len(ids), SpecCache.CHUNK):
        found = session.execute(
            select(JobRow.id, JobRunRow.node_id)
            .join(JobRunRow, JobRunRow.id == JobRow.current_run_id)
            .where(
                JobRow.id.in_(ids[start : start + SpecCache.CHUNK]),
                JobRunRow.status == RunStatus.FAILED,
                JobRunRow.started_at.is_(None),
            )
        ).all()
        out.update((job_id, node_id) for job_id, node_id in found)
    return out


def handshake_savings(session: Session, job_ids: Iterable[str]) -> dict[str, float]:
    """Job id -> the seconds of grace a stop of its attempt is expected not to wait
    (``RunningJob.handshake_saves_s``), for the jobs of ``job_ids`` whose latest
    ``checkpoint_handshake`` event (an earlier attempt's stop, ``services.run_completion``)
    says it signalled: that stop's ``grace_s - signal_after_s``, never below 0. Jobs absent:
    never stopped with SIGTERM, or their latest stop did not signal. One query per
    :data:`SpecCache.CHUNK` jobs (``ix_scheduling_events_job``); callers pass only jobs on a
    later attempt (``job_runs.attempt`` > 1: a first attempt has no earlier stop)."""
    ids = sorted(set(job_ids))
    latest: dict[str, Any] = {}
    for start in range(0, len(ids), SpecCache.CHUNK):
        rows = session.execute(
            select(SchedulingEventRow.job_id, SchedulingEventRow.details)
            .where(
                SchedulingEventRow.job_id.in_(ids[start : start + SpecCache.CHUNK]),
                SchedulingEventRow.kind == "checkpoint_handshake",
            )
            .order_by(SchedulingEventRow.id)
        ).all()
        latest.update((job_id, details) for job_id, details in rows)
    out: dict[str, float] = {}
    for job_id, details in latest.items():
        d = details if isinstance(details, dict) else {}
        after, grace = d.get("signal_after_s"), d.get("grace_s")
        if (
            d.get("signalled")
            and isinstance(after, int | float)
            and isinstance(grace, int | float)
        ):
            out[job_id] = max(0.0, float(grace) - float(after))
    return out


def running_job(
    run: Any,
    facts: SpecFacts,
    gpu_type: str,
    *,
    live: bool,
    stopping_for: Mapping[str, str | None],
    predicted_s: float | None,
    handshake_saves_s: float = 0.0,
) -> RunningJob:
    """The policy's view of an attempt member holding GPUs (a row of ``RUNNING_COLUMNS``).
    ``live``: the member itself still runs; an ended run that still holds a live
    reservation (none on the usual paths: each member's completion releases its own GPUs)
    counts as stopping when its job has a PREEMPTING member (``stopping_for``: job id -> the
    preemptor it stops for). ``handshake_saves_s``: :func:`handshake_savings` of its job."""
    return RunningJob(
        run_id=run.id,
        job_id=run.job_id,
        team_id=run.team_id,
        node_id=run.node_id,
        priority=PriorityClass(run.priority),
        gpu_count=len(run.gpu_ids),
        gpu_type=gpu_type,
        gpu_milli=facts.resources.gpu_milli,
        gpu_index=int(run.gpu_ids[0]) if facts.resources.gpu_milli and run.gpu_ids else None,
        started_at_s=(run.started_at or run.created_at).timestamp(),
        last_checkpoint_s=(
            run.last_checkpoint_at.timestamp() if run.last_checkpoint_at is not None else None
        ),
        cpu=facts.resources.cpu,
        memory_mb=facts.resources.memory_mb,
        expected_duration_s=facts.expected_duration_s,
        max_runtime_s=run.max_runtime_s,
        preemptible=facts.preemptible,
        predicted_duration_s=predicted_s,
        handshake_saves_s=handshake_saves_s,
        stopping=run.status == RunStatus.PREEMPTING or (not live and run.job_id in stopping_for),
        stopping_for_job_id=run.preempted_for_job_id if live else stopping_for.get(run.job_id),
        rank=run.rank,
        gang_size=run.gang_size,
        queued_at_s=run.queued_at.timestamp() if run.queued_at is not None else None,
    )


class SpecCache:
    """Parsed job specs kept across scheduling passes, so a pass reads and decodes only the
    specs of jobs it has not seen yet. Entries of jobs absent from a pass are dropped. A spec
    changes only by a PATCH of a PENDING job's GPUs (``services.jobctl.patch_job``), which a
    cache kept across passes does not see: the leader's ``store.snapshot_cache`` reads a
    changed pending job's spec again; ``load_snapshot`` without a cache reads every spec."""

    CHUNK = 500

    def __init__(self) -> None:
        self._facts: dict[str, SpecFacts] = {}
        self._pending: dict[str, tuple[tuple[Any, ...], PendingJob]] = {}

    def pending_job(
        self,
        row: Any,
        facts: SpecFacts,
        predicted_s: float | None = None,
        avoid_node_id: str | None = None,
    ) -> PendingJob:
        """The PendingJob of a row; the same object as last pass while the job's attempt,
        queue time and prediction are unchanged (building 10,000 of them is a large part of
        a pass)."""
        # priority and max_runtime_s can change after submit (PATCH /v1/jobs/{id})
        key = (
            row.attempts,
            row.queued_at,
            row.priority,
            row.max_runtime_s,
            predicted_s,
            avoid_node_id,
        )
        cached = self._pending.get(row.id)
        if cached is not None and cached[0] == key:
            return cached[1]
        job = pending_job(row, facts, predicted_s, avoid_node_id)
        self._pending[row.id] = (key, job)
        return job

    def lookup(self, session: Session, job_ids: list[str]) -> dict[str, SpecFacts]:
        missing = [j for j in job_ids if j not in self._facts]
        for start in range(0, len(missing), self.CHUNK):
            chunk = missing[start : start + self.CHUNK]
            for job_id, spec in session.execute(
                select(JobRow.id, JobRow.spec).where(JobRow.id.in_(chunk))
            ):
                self._facts[job_id] = spec_facts(spec)
        wanted = set(job_ids)
        self._facts = {j: f for j, f in self._facts.items() if j in wanted}
        self._pending = {j: p for j, p in self._pending.items() if j in wanted}
        return self._facts


RUNNING_COLUMNS = (
    JobRunRow.id,
    JobRunRow.job_id,
    JobRunRow.attempt,
    JobRunRow.node_id,
    JobRunRow.status,
    JobRunRow.gpu_ids,
    JobRunRow.started_at,
    JobRunRow.created_at,
    JobRunRow.last_checkpoint_at,
    JobRunRow.preempted_for_job_id,
    JobRunRow.rank,
    JobRunRow.gang_size,
    JobRow.team_id,
    # the class the attempt was placed at (a team limit may have demoted it), else the job's
    func.coalesce(JobRunRow.priority, JobRow.priority).label("priority"),
    JobRow.max_runtime_s,
    JobRow.name,
    JobRow.submitted_by,
    JobRow.gpu_count,
    JobRow.queued_at,
)
"""What a snapshot reads of a running attempt and its job (``load_snapshot`` and the
leader's ``store.snapshot_cache``)."""


def load_snapshot(
    session: Session,
    now: datetime,
    *,
    reservations: tuple[BackfillReservation, ...] = (),
    usage_half_life_s: float = 7 * 24 * 3600.0,
    spec_cache: SpecCache | None = None,
    predictions: HistoryPredictor | None = None,
    displacement_window_s: float = 6 * 3600.0,
    fence_after_s: float | None = None,
) -> ClusterSnapshot:
    """Everything one scheduling pass needs, in a handful of indexed queries (call inside
    ``Database.snapshot()`` so that they all see one moment).

    Args:
        reservations: the backfill reservations of the previous pass (kept by the leader).
        usage_half_life_s: decay of charged usage (``policy.usage``).
        spec_cache: the scheduler's cache of parsed job specs across passes.
        predictions: the leader's duration predictor (``store.predictions``): fills
            ``predicted_duration_s`` of pending and running work (None: no predictions).
        displacement_window_s: how far back preempted runs are read as
            ``recent_displacements`` (the longer of one hour and the policy's
            ``anti_thrash_s``), seconds.
        fence_after_s: a silent node's time to its fence (:func:`node_state`), seconds.
    """
    now_s = now.timestamp()
    node_rows = session.execute(
        select(
            NodeRow.id,
            NodeRow.gpu_type,
            NodeRow.gpu_memory_mb,
            NodeRow.cpu,
            NodeRow.memory_mb,
            NodeRow.labels,
            NodeRow.admin_labels,
            NodeRow.status,
            NodeRow.images,
            NodeRow.gpu_sharing,
            NodeRow.last_heartbeat_at,
            NodeCapacityRow.total_gpus,
            NodeCapacityRow.available_gpus,
        ).join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
    ).all()
    nodes = [node_state(n, fence_after_s) for n in node_rows]
    specs = spec_cache if spec_cache is not None else SpecCache()
    # plain rows, not ORM objects, and no spec: at 10,000 pending, decoding every job's JSON
    # spec each pass costs more than the queries (the spec is immutable: see SpecCache)
    pending_rows = session.execute(
        select(
            JobRow.id,
            JobRow.team_id,
            JobRow.priority,
            JobRow.created_at,
            JobRow.queued_at,
            JobRow.attempts,
            JobRow.max_runtime_s,
            JobRow.name,
            JobRow.submitted_by,
            JobRow.gpu_count,
        ).where(
            JobRow.status == JobStatus.PENDING,
            JobRow.cancel_requested.is_(False),
            # a retry in its backoff is not eligible yet (its pending_reason says until when)
            or_(JobRow.retry_after.is_(None), JobRow.retry_after <= now),
        )
    ).all()
    running_columns = RUNNING_COLUMNS
    running_rows = list(
        session.execute(
            select(*running_columns)
            .join(JobRow, JobRow.id == JobRunRow.job_id)
            .where(
                JobRunRow.status.in_([RunStatus.ASSIGNED, RunStatus.RUNNING, RunStatus.PREEMPTING])
            )
        ).all()
    )
    reserved_at = dict(
        session.execute(
            select(ReservationRow.run_id, ReservationRow.created_at).where(
                ReservationRow.status.in_(
                    [ReservationStatus.RESERVED, ReservationStatus.CONFIRMED]
                )
            )
        ).all()
    )
    # an ended run whose live reservation is still held (each member's completion releases
    # its own GPUs, so none on the usual paths): list it too, so the policy sees who holds them
    live_ids = {r.id for r in running_rows}
    held = sorted(run_id for run_id in reserved_at if run_id not in live_ids)
    stopping_for = {
        r.job_id: r.preempted_for_job_id for r in running_rows if r.status == RunStatus.PREEMPTING
    }
    for start in range(0, len(held), SpecCache.CHUNK):
        running_rows += session.execute(
            select(*running_columns)
            .join(JobRow, JobRow.id == JobRunRow.job_id)
            .where(JobRunRow.id.in_(held[start : start + SpecCache.CHUNK]))
        ).all()
    facts = specs.lookup(session, [r.id for r in pending_rows] + [r.job_id for r in running_rows])

    def predicted(row: Any) -> float | None:
        if predictions is None:
            return None
        return predictions.predict_s(row.team_id, row.submitted_by, row.name, row.gpu_count)

    avoid = failed_start_nodes(session, pending_rows)
    pending = [
        specs.pending_job(row, facts[row.id], predicted(row), avoid.get(row.id))
        for row in pending_rows
    ]
    gpu_type_of = {n.node_id: n.gpu_type for n in nodes}
    saves = handshake_savings(session, (r.job_id for r in running_rows if r.attempt > 1))
    running = []
    for run in running_rows:
        running.append(
            running_job(
                run,
                facts[run.job_id],
                gpu_type_of.get(run.node_id, ""),
                live=run.id in live_ids,
                stopping_for=stopping_for,
                predicted_s=predicted(run),
                handshake_saves_s=saves.get(run.job_id, 0.0),
            )
        )
    running_by_team: dict[str, list[tuple[float, float]]] = {}
    for r in running:
        since = reserved_at.get(r.run_id)
        start_s = since.timestamp() if since is not None else r.started_at_s
        running_by_team.setdefault(r.team_id, []).append((r.gpus, start_s))
    teams = {}
    for t in session.scalars(select(TeamRow)):
        as_of = (t.usage_as_of or now).timestamp()
        ledger = UsageLedger(t.usage_gpu_s, min(as_of, now_s), usage_half_life_s)
        teams[t.id] = TeamState(
            team_id=t.id,
            weight=t.weight,
            guaranteed_gpus=dict(t.guaranteed_gpus or {}),
            borrow_limit_gpus=t.borrow_limit_gpus,
            # the table stores Kueue's lendingLimit (the most of the guarantee lent out);
            # the policy works with the part kept back: nominal quota - lendingLimit
            lending_limit_gpus=kept_back(t.guaranteed_gpus or {}, t.lending_limit_gpus or {}),
            usage_gpu_s=ledger.with_running(now_s, running_by_team.get(t.id, [])),
        )
    holds = tuple(
        GpuHold(h.job_id, h.node_id, h.gpu_count, h.since.timestamp(), h.reason)
        for h in session.scalars(
            select(GpuHoldRow).order_by(GpuHoldRow.job_id, GpuHoldRow.node_id)
        )
    )
    return ClusterSnapshot(
        now_s=now_s,
        nodes=tuple(nodes),
        pending=tuple(pending),
        running=tuple(running),
        teams=teams,
        holds=holds,
        reservations=reservations,
        recent_displacements=recent_displacements(session, now, displacement_window_s),
    )


def recent_displacements(
    session: Session, now: datetime, window_s: float
) -> tuple[Displacement, ...]:
    """Runs told to stop by a preemption in the last ``window_s`` seconds, oldest first, as
    ``Displacement(job_id, at_s, gpu_hours, reason)``: ``at_s`` is ``stop_requested_at``,
    ``gpu_hours`` the run's GPUs x time from the later of its start and its last checkpoint
    (``last_checkpoint_at``, reported by its agent) to ``at_s`` (the work lost), ``reason``
    the policy's ground (``job_runs.preempt_reason``; ``preempt`` for runs stopped before that
    column existed). One indexed range query."""
    since = now - timedelta(seconds=window_s)
    rows = session.execute(
        select(
            JobRunRow.job_id,
            JobRunRow.stop_requested_at,
            JobRunRow.started_at,
            JobRunRow.created_at,
            JobRunRow.last_checkpoint_at,
            JobRunRow.gpu_ids,
            JobRunRow.preempt_reason,
        )
        .where(JobRunRow.stop_requested_at >= since, JobRunRow.stop_reason == "preempt")
        .order_by(JobRunRow.stop_requested_at, JobRunRow.id)
    ).all()
    out = []
    for r in rows:
        at = r.stop_requested_at.timestamp()
        began = (r.started_at or r.created_at).timestamp()
        if r.last_checkpoint_at is not None:
            began = max(began, r.last_checkpoint_at.timestamp())
        gpu_h = len(r.gpu_ids or ()) * max(0.0, at - began) / 3600.0
        out.append(Displacement(r.job_id, at, gpu_h, r.preempt_reason or "preempt"))
    return tuple(out)


def load_invariant_view(session: Session) -> InvariantView:
    """The whole allocation state, read in one transaction, for ``check_invariants``."""
    holders: dict[str, dict[int, str | None]] = {}
    shares: dict[str, dict[int, int]] = {}
    for g in session.scalars(select(NodeGpuRow)):
        holders.setdefault(g.node_id, {})[g.gpu_index] = g.holder_run_id
        if g.shared_milli:
            shares.setdefault(g.node_id, {})[g.gpu_index] = g.shared_milli
    beats = {
        n.id: (n.last_heartbeat_at, n.health)
        for n in session.execute(select(NodeRow.id, NodeRow.last_heartbeat_at, NodeRow.health))
    }

    def listed(node_id: str) -> frozenset[str] | None:
        health = beats.get(node_id, (None, None))[1]
        runs = health.get("runs") if isinstance(health, dict) else None
        return frozenset(runs) if isinstance(runs, list) else None

    def beat(node_id: str) -> float | None:
        at = beats.get(node_id, (None, None))[0]
        return at.timestamp() if at is not None else None

    nodes = tuple(
        NodeView(
            c.node_id,
            c.total_gpus,
            c.available_gpus,
            holders.get(c.node_id, {}),
            last_heartbeat_s=beat(c.node_id),
            listed_runs=listed(c.node_id),
            gpu_shares=shares.get(c.node_id, {}),
        )
        for c in session.scalars(select(NodeCapacityRow))
    )
    reservations = tuple(
        ReservationView(
            r.id, r.run_id, r.job_id, r.node_id, tuple(r.gpu_ids), r.status, r.gpu_milli
        )
        for r in session.scalars(
            select(ReservationRow).where(ReservationRow.status.in_(sorted(RESERVATION_ACTIVE)))
        )
    )
    jobs = tuple(
        JobView(j.id, j.status, j.current_run_id, j.fencing_epoch)
        for j in session.scalars(select(JobRow))
    )
    runs = tuple(
        RunView(
            r.id,
            r.job_id,
            r.status,
            r.token,
            r.status == RunStatus.SUCCEEDED,
            node_id=r.node_id,
            created_at_s=r.created_at.timestamp(),
            started_at_s=r.started_at.timestamp() if r.started_at else None,
            stop_requested_at_s=r.stop_requested_at.timestamp() if r.stop_requested_at else None,
            rank=r.rank,
            gang_size=r.gang_size,
        )
        for r in session.scalars(select(JobRunRow))
    )
    return InvariantView(nodes, reservations, jobs, runs)


def check_database(
    db: Database,
    *,
    grace_s: float | None = None,
    confirm_timeout_s: float | None = None,
    margin_s: float = 30.0,
    fence_after_s: float | None = None,
    heartbeat_interval_s: float = 0.0,
) -> tuple[InvariantView, list[Violation]]:
    """Read the allocation state in one consistent snapshot and check invariants 1-4; with
    ``grace_s`` and ``confirm_timeout_s`` also the stuck states of invariant 6 (as of the
    database clock). ``fence_after_s`` and ``heartbeat_interval_s``: a stop on a silent node
    is waited for until the fence (``StuckLimits``); pass :func:`fence_after_s` of the
    settings."""
    with db.snapshot() as session:
        view = load_invariant_view(session)
        now_s = db_now(session).timestamp()
    limits = None
    if grace_s is not None and confirm_timeout_s is not None:
        limits = StuckLimits(
            now_s, grace_s, confirm_timeout_s, margin_s, fence_after_s, heartbeat_interval_s
        )
    return view, check_invariants(view, limits)


def kept_back(guaranteed: dict[str, Any], lending_limit: dict[str, Any]) -> dict[str, int]:
    """Per GPU type, the part of the guarantee never lent, from Kueue's ``lendingLimit``
    (``nominalQuota - lendingLimit``, at least 0); a type without a lending limit keeps
    nothing back (all of its guarantee may be lent)."""
    return {str(t): max(0, int(guaranteed.get(t, 0)) - int(n)) for t, n in lending_limit.items()}
