"""Scheduler metrics of the controller, for Prometheus (``prometheus-client``).

Two kinds:

* **Events** (counters and histograms, updated as things happen): scheduling passes and their
  decisions, placements, backfills, preemptions by reason, queue wait at placement, time to
  start, leadership changes, reconciler outcomes, failure-detector transitions.
* **State** (gauges and gauge histograms), computed by the leader from the snapshot its
  scheduling pass already loaded (:func:`observe_pass`, no extra query) and served by a
  collector from the last pass's values: queue depth and age by team, priority class and
  GPU-count bucket; GPUs by type and node status (free / allocated / quarantined / held);
  free GPUs per node; the largest single-node job that fits now; per-team allocation,
  guarantee, borrowed GPUs, dominant share and decayed usage.

Only the leader publishes state: a controller that is not (or no longer) the leader serves
no state gauges, so summing over every controller's scrape never counts the fleet twice.
Cardinality is bounded by teams x GPU types x priority classes x 5 size buckets; no job,
attempt or node id is ever a label (node ids appear only in agents' own scrape targets).

Everything is registered in prometheus-client's default registry: ``gpufleet controller
--metrics-port`` serves it, and so does the API server's ``/metrics`` in ``gpufleet up``
(server and controller share one process there).

Units follow the Prometheus conventions: seconds, GPUs (a count), ratios in [0, 1].
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import select

from gpufleet.domain.types import Resources
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.decisions import (
    CycleResult,
    Decision,
    HoldForBackfill,
    Place,
    PlaceGang,
    Preempt,
)
from gpufleet.policy.limits import BudgetStatus
from gpufleet.policy.placement import FreeIndex
from gpufleet.policy.priority import queued_at
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.snapshot import ClusterSnapshot, PendingJob
from gpufleet.policy.waste import lost_gpu_h
from gpufleet.store.db import Database, is_unavailable
from gpufleet.store.tables import JobRow, JobRunRow

log = logging.getLogger("gpufleet.controller")

SIZE_BUCKETS = ("1", "2", "4", "8", "gang")
"""GPU-count buckets of a job: the smallest of 1, 2, 4, 8 that holds its GPUs on one node
(``8`` also takes single-node jobs of more than 8 GPUs), ``gang`` for a multi-node job."""

AGE_BUCKETS_S = (
    1.0,
    5.0,
    15.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
    4 * 3600.0,
    12 * 3600.0,
    86400.0,
    3 * 86400.0,
)
"""Bucket bounds (seconds) for queue age, queue wait and time to start: the seed's starvation
questions are about minutes to days."""

FREE_GPU_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 16.0)
"""Bucket bounds (GPUs) of the free-GPUs-per-node histogram (fragmentation, DD7)."""

PASS_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
DECISION_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)


def size_bucket(resources: Resources) -> str:
    """The ``gpus`` label of a job: ``1``, ``2``, ``4``, ``8`` or ``gang`` (see SIZE_BUCKETS)."""
    if resources.nodes is not None and resources.nodes > 1:
        return "gang"
    return gpu_bucket(resources.gpu_count)


def gpu_bucket(gpu_count: int) -> str:
    """``1``, ``2``, ``4`` or ``8`` for a single-node job of ``gpu_count`` GPUs."""
    for bound in (1, 2, 4):
        if gpu_count <= bound:
            return str(bound)
    return "8"


# ---- events -------------------------------------------------------------------------------

PASS_SECONDS = Histogram(
    "gpufleet_scheduler_pass_duration_seconds",
    "Wall time of one scheduling pass: snapshot, policy and applying its decisions.",
    buckets=PASS_BUCKETS_S,
)
PASS_DECISIONS = Histogram(
    "gpufleet_scheduler_pass_decisions",
    "Decisions returned by one scheduling pass (places, preemptions, backfill holds).",
    buckets=DECISION_BUCKETS,
)
DECISIONS = Counter(
    "gpufleet_scheduler_decisions_total",
    "Decisions applied by the leader, by kind (place, place_gang, preempt, hold_for_backfill).",
    ["kind"],
)
CONFLICTS = Counter(
    "gpufleet_scheduler_conflicts_total",
    "Decisions skipped because the database had moved on (capacity taken, state changed).",
)
PLACEMENTS = Counter(
    "gpufleet_placements_total",
    "Jobs placed (a reservation committed), by GPU-count bucket and whether backfilled.",
    ["gpus", "backfilled"],
)
BACKFILLS = Counter(
    "gpufleet_backfills_total",
    "Jobs placed by backfill (ahead of a blocked job, ending before its reservation).",
    ["gpus"],
)
PREEMPTIONS = Counter(
    "gpufleet_preemptions_total",
    "Attempts the leader asked to stop to make room, by reason: reclaim (a team takes back "
    "its guarantee) or priority (strictly higher-priority work).",
    ["reason"],
)
PREEMPTION_WASTE = Counter(
    "gpufleet_preemption_waste_gpu_hours_total",
    "GPU-hours of work lost to the preemptions the leader made, by victim team: GPUs x time "
    "since each victim's last checkpoint (or its start); what the preemption waste cap "
    "(policy.waste) counts.",
    ["team"],
)
STOPS = Counter(
    "gpufleet_stop_requests_total",
    "Attempts moved to PREEMPTING by the stop driver, by reason (cancel, timeout).",
    ["reason"],
)
QUEUE_WAIT = Histogram(
    "gpufleet_queue_wait_seconds",
    "Time from entering the queue to placement, observed at placement.",
    ["gpus", "priority"],
    buckets=AGE_BUCKETS_S,
)
TIME_TO_START = Histogram(
    "gpufleet_time_to_start_seconds",
    "Time from entering the queue to a running process (the agent's confirmation), by image "
    "presence on the node: warm, cold, none (a host-process job) or unknown.",
    ["image", "gpus"],
    buckets=AGE_BUCKETS_S,
)
LEADER_CHANGES = Counter(
    "gpufleet_leader_changes_total",
    "Times this controller's leadership changed (acquired or lost).",
    ["to"],
)
RECONCILE = Counter(
    "gpufleet_reconcile_outcomes_total",
    "Reconciler and stop-driver outcomes: resent_assignment, never_started, fenced_run.",
    ["outcome"],
)
NODE_TRANSITIONS = Counter(
    "gpufleet_failure_detector_transitions_total",
    "Node status changes made by the failure detector, by new status (SUSPECT, FENCED, "
    "CORDONED after a drain).",
    ["to"],
)
NODE_STATUS_CHANGES = Counter(
    "gpufleet_node_status_changes_total",
    "Node status changes seen between two consecutive passes of the leader, whoever made "
    "them (failure detector, heartbeats resuming, health checks, operators).",
    ["from_status", "to_status"],
)
LEADER_EPOCH = Gauge(
    "gpufleet_leader_epoch",
    "Leader epoch held by this controller (0 when it is not the leader).",
)
IS_LEADER = Gauge("gpufleet_leader", "1 when this controller holds the leader lease, else 0.")


# ---- state from the pass's snapshot --------------------------------------------------------


@dataclass
class FleetView:
    """What the leader's last pass saw, reduced to label sets and numbers."""

    at_monotonic: float = 0.0
    queue_depth: dict[tuple[str, str, str], int] = field(default_factory=dict)
    queue_age: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    gpus: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """(gpu_type, node_status, use) -> GPUs; use is total, free, allocated, quarantined."""
    held: dict[tuple[str, str], int] = field(default_factory=dict)
    """(gpu_type, reason) -> GPUs held for a job (backfill reservation or preemption)."""
    nodes: dict[tuple[str, str], int] = field(default_factory=dict)
    free_per_node: dict[str, list[int]] = field(default_factory=dict)
    largest_fit: dict[str, int] = field(default_factory=dict)
    team_gpus: dict[tuple[str, str, str], float] = field(default_factory=dict)
    """(team, gpu_type, kind) -> GPUs; kind is allocated, guaranteed, borrowed."""
    team_share: dict[str, float] = field(default_factory=dict)
    team_usage: dict[str, float] = field(default_factory=dict)
    team_weight: dict[str, float] = field(default_factory=dict)
    pending: int = 0


def fleet_view(
    snap: ClusterSnapshot, result: CycleResult | None, config: PolicyConfig | None = None
) -> FleetView:
    """Reduce a pass's snapshot (and its decisions) to the state gauges. Pure and cheap:
    one walk over pending jobs, attempts and nodes."""
    cfg = config or PolicyConfig()
    view = FleetView(at_monotonic=time.monotonic())
    pending: Iterable[PendingJob] = (
        snap.pending if snap.queues is None else (j for q in snap.queues.values() for j in q)
    )
    for job in pending:
        key = (job.team_id, str(job.priority), size_bucket(job.resources))
        view.queue_depth[key] = view.queue_depth.get(key, 0) + 1
        view.queue_age.setdefault(key, []).append(max(0.0, snap.now_s - queued_at(job)))
        view.pending += 1
    by_node: dict[str, int] = {}
    for r in snap.running:
        by_node[r.node_id] = by_node.get(r.node_id, 0) + r.gpu_count
    for n in snap.nodes:
        allocated = by_node.get(n.node_id, 0)
        # GPUs neither free nor held by a live attempt are held by fenced attempts whose
        # processes nobody has seen end: the QUARANTINED reservations
        quarantined = max(0, n.total_gpus - n.free_gpus - allocated)
        for use, value in (
            ("total", n.total_gpus),
            ("free", n.free_gpus),
            ("allocated", allocated),
            ("quarantined", quarantined),
        ):
            k = (n.gpu_type, n.status, use)
            view.gpus[k] = view.gpus.get(k, 0) + value
        view.nodes[(n.gpu_type, n.status)] = view.nodes.get((n.gpu_type, n.status), 0) + 1
        if n.schedulable:
            view.free_per_node.setdefault(n.gpu_type, []).append(n.free_gpus)
            view.largest_fit[n.gpu_type] = max(view.largest_fit.get(n.gpu_type, 0), n.free_gpus)
        else:
            view.largest_fit.setdefault(n.gpu_type, 0)
    type_of = {n.node_id: n.gpu_type for n in snap.nodes}
    for h in snap.holds:
        hk = (type_of.get(h.node_id, ""), h.reason or "reclaim")
        view.held[hk] = view.held.get(hk, 0) + h.gpu_count
    for d in result.decisions if result is not None else ():
        if isinstance(d, HoldForBackfill):
            hk = (type_of.get(d.node_id, ""), "backfill")
            view.held[hk] = view.held.get(hk, 0) + d.gpu_count
    index = FreeIndex(snap.nodes, ())
    book = TeamBook(
        snap.teams,
        snap.running,
        index.capacity_gpus,
        index.capacity_cpu,
        index.capacity_memory_mb,
        cfg,
    )
    for team_id in sorted(set(snap.teams) | set(book.alloc)):
        ts = book.team(team_id)
        types = set(ts.guaranteed_gpus) | set(book.alloc.get(team_id, {}))
        for t in types:
            alloc, guar = book.allocated(team_id, t), book.guarantee(team_id, t)
            view.team_gpus[(team_id, t, "allocated")] = alloc
            view.team_gpus[(team_id, t, "guaranteed")] = guar
            view.team_gpus[(team_id, t, "borrowed")] = max(0, alloc - guar)
        view.team_share[team_id] = book.dominant_share(team_id)
        view.team_usage[team_id] = ts.usage_gpu_s
        view.team_weight[team_id] = ts.weight
    return view


class _Published:
    """The last pass's inputs, reduced to a :class:`FleetView` only when scraped: a pass
    costs a reference assignment, and the reduction (tens of ms at 10,000 pending jobs)
    runs at most once per pass and scrape, on the scraper's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.view: FleetView | None = None
        self.pending: tuple[ClusterSnapshot, CycleResult | None, PolicyConfig | None] | None = None
        self.lease_renewed_monotonic: float | None = None
        self.node_status: dict[str, str] | None = None
        """Node statuses of the previous pass (None: no pass yet under this leadership)."""
        self.budgets: Mapping[tuple[str, str], BudgetStatus] = {}
        """Every team budget at the last pass (``policy.limits``): the budget gauges."""

    def current(self) -> FleetView | None:
        with self.lock:
            pending, view = self.pending, self.view
        if pending is None:
            return view
        # reduced outside the lock: the scheduling thread never waits for a scrape
        view = fleet_view(*pending)
        with self.lock:
            if self.pending is pending:  # no newer pass (or leadership loss) meanwhile
                self.view, self.pending = view, None
        return view


_published = _Published()


def publish(view: FleetView | None) -> None:
    """Serve ``view`` as the state gauges from now on (None: serve none, e.g. not leader)."""
    with _published.lock:
        _published.view, _published.pending = view, None


def publish_budgets(statuses: Mapping[tuple[str, str], BudgetStatus]) -> None:
    """Serve these team budgets (``policy.limits.BudgetStatus`` by (team, key)) as
    ``gpufleet_team_budget_*`` from now on (the leader's last pass)."""
    with _published.lock:
        _published.budgets = statuses


def publish_pass(
    snap: ClusterSnapshot, result: CycleResult | None, config: PolicyConfig | None = None
) -> None:
    """Serve the state of this pass from now on; reduced lazily at the next scrape."""
    with _published.lock:
        _published.pending = (snap, result, config)


def note_lease(epoch: int) -> None:
    """Record the outcome of a lease acquire/renew attempt of this controller."""
    was = LEADER_EPOCH._value.get()  # prometheus-client keeps the current value here
    if bool(was) != bool(epoch):
        LEADER_CHANGES.labels("leader" if epoch else "follower").inc()
    LEADER_EPOCH.set(epoch)
    IS_LEADER.set(1 if epoch else 0)
    with _published.lock:
        _published.lease_renewed_monotonic = time.monotonic() if epoch else None
        if not epoch:
            _published.view, _published.pending = None, None
            _published.node_status = None
            _published.budgets = {}


_KIND: dict[type, str] = {
    Place: "place",
    PlaceGang: "place_gang",
    HoldForBackfill: "hold_for_backfill",
}


def observe_pass(
    snap: ClusterSnapshot,
    result: CycleResult,
    applied: Sequence[Decision],
    *,
    seconds: float,
    conflicts: int,
    config: PolicyConfig | None = None,
    pending_by_id: Mapping[str, PendingJob] | None = None,
) -> None:
    """Record one leader pass: its duration, its decisions (``applied``: those committed),
    placements with their queue wait, and the state gauges from its snapshot."""
    PASS_SECONDS.observe(seconds)
    PASS_DECISIONS.observe(len(result.decisions))
    if conflicts:
        CONFLICTS.inc(conflicts)
    # counted per label set first: one labels() lookup per set, not per decision (a pass
    # can place hundreds of jobs)
    kinds: dict[str, int] = {}
    placements: dict[tuple[str, str], int] = {}
    waits: dict[tuple[str, str], list[float]] = {}
    places = [d for d in applied if isinstance(d, (Place, PlaceGang))]
    placed = {d.job_id for d in places}
    if pending_by_id is not None:  # the driver's index: no scan of the queue
        jobs = {j: pending_by_id[j] for j in placed if j in pending_by_id}
    else:
        jobs = {p.job_id: p for p in _pending(snap) if p.job_id in placed} if placed else {}
    for d in applied:
        kind = _KIND.get(type(d), "preempt")
        kinds[kind] = kinds.get(kind, 0) + 1
    for d in places:
        job = jobs.get(d.job_id)
        if isinstance(d, PlaceGang):
            gpus = "gang"
        else:
            gpus = size_bucket(job.resources) if job is not None else gpu_bucket(d.gpu_count)
        key = (gpus, "true" if d.backfilled else "false")
        placements[key] = placements.get(key, 0) + 1
        if job is not None:
            waits.setdefault((gpus, str(job.priority)), []).append(
                max(0.0, snap.now_s - queued_at(job))
            )
    for kind, n in kinds.items():
        DECISIONS.labels(kind).inc(n)
    for (gpus, backfilled), n in placements.items():
        PLACEMENTS.labels(gpus, backfilled).inc(n)
        if backfilled == "true":
            BACKFILLS.labels(gpus).inc(n)
    for labels, values in waits.items():
        child = QUEUE_WAIT.labels(*labels)
        for v in values:
            child.observe(v)
    _count_node_changes(snap)
    publish_pass(snap, result, config)


def _count_node_changes(snap: ClusterSnapshot) -> None:
    now = {n.node_id: n.status for n in snap.nodes}
    with _published.lock:
        before, _published.node_status = _published.node_status, now
    if before is None:
        return
    changes: dict[tuple[str, str], int] = {}
    for node_id, status in now.items():
        old = before.get(node_id)
        if old is not None and old != status:
            changes[(old, status)] = changes.get((old, status), 0) + 1
    for (old, new), n in changes.items():
        NODE_STATUS_CHANGES.labels(old, new).inc(n)


def _pending(snap: ClusterSnapshot) -> Iterator[PendingJob]:
    if snap.queues is None:
        yield from snap.pending
    else:
        for q in snap.queues.values():
            yield from q


def observe_start(
    queued_s: float, started_s: float, start_phases: dict[str, object] | None, gpus: str
) -> None:
    """A job's attempt reached a running process: observe its time to start."""
    phases = start_phases or {}
    image = str(phases.get("image") or "")
    if image not in ("warm", "cold"):
        image = "none" if phases.get("runtime") == "process" else "unknown"
    TIME_TO_START.labels(image, gpus).observe(max(0.0, started_s - queued_s))


_started_lock = threading.Lock()
_started: dict[str, None] = {}
_STARTED_MAX = 10_000


class StartFacts(Protocol):
    """What the time-to-start metric needs of a confirmed attempt (``runs.Confirmed``)."""

    @property
    def started_at(self) -> datetime | None: ...
    @property
    def start_phases(self) -> dict[str, Any] | None: ...
    @property
    def queued_at(self) -> datetime | None: ...
    @property
    def gpu_count(self) -> int: ...
    @property
    def spec(self) -> dict[str, Any] | None: ...


def record_start(db: Database, run_id: str, known: StartFacts | None = None) -> None:
    """After a confirmed start: observe the attempt's time to start once per run id (a
    repeated ConfirmAssignment is not counted again). ``known``: the facts the confirmation
    already read (no statement); else one primary-key read. A failure is logged and never
    fails the confirmation."""
    with _started_lock:
        if run_id in _started:
            return
        _started[run_id] = None
        if len(_started) > _STARTED_MAX:
            _started.pop(next(iter(_started)))
    row: StartFacts | Any = known
    if row is None:
        try:
            with db.read() as s:
                row = s.execute(
                    select(
                        JobRunRow.started_at,
                        JobRunRow.start_phases,
                        JobRow.queued_at,
                        JobRow.gpu_count,
                        JobRow.spec,
                    )
                    .join(JobRow, JobRow.id == JobRunRow.job_id)
                    .where(JobRunRow.id == run_id)
                ).first()
        except Exception as exc:
            if is_unavailable(exc):  # the outage is logged once by the RPC that called
                return
            log.warning("time-to-start of %s not recorded", run_id, exc_info=True)
            return
    if row is None or row.started_at is None or row.queued_at is None:
        return
    nodes = (row.spec.get("resources") or {}).get("nodes") if isinstance(row.spec, dict) else None
    gpus = "gang" if isinstance(nodes, int) and nodes > 1 else gpu_bucket(row.gpu_count)
    observe_start(row.queued_at.timestamp(), row.started_at.timestamp(), row.start_phases, gpus)


class FleetCollector(Collector):
    """Serves the leader's last :class:`FleetView` as gauges and gauge histograms."""

    def collect(self) -> Iterator[Metric]:
        view = _published.current()
        with _published.lock:
            renewed = _published.lease_renewed_monotonic
        lease_age = GaugeMetricFamily(
            "gpufleet_leader_lease_age_seconds",
            "Seconds since this controller last renewed the leader lease (absent when it "
            "is not the leader).",
        )
        if renewed is not None:
            lease_age.add_metric([], time.monotonic() - renewed)
        yield lease_age
        yield from _state_metrics(view)
        with _published.lock:
            budgets = _published.budgets if renewed is not None else {}
        yield from _budget_metrics(budgets)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # values change label sets; describe nothing (collected lazily)


def _state_metrics(view: FleetView | None) -> Iterator[Metric]:
    labels_q = ["team", "priority", "gpus"]
    depth = GaugeMetricFamily(
        "gpufleet_queue_depth_jobs",
        "Jobs waiting in the scheduler's queue (PENDING, no cancel requested, not in a retry "
        "backoff), by team, priority class and GPU-count bucket.",
        labels=labels_q,
    )
    age = GaugeHistogramMetricFamily(
        "gpufleet_queue_age_seconds",
        "Age of every queued job (now minus when it entered the queue), as a histogram of the "
        "current queue.",
        labels=labels_q,
    )
    gpus = GaugeMetricFamily(
        "gpufleet_gpus",
        "GPUs by type, node status and use: total, free, allocated (held by a live attempt), "
        "quarantined (held by a fenced attempt not yet seen gone).",
        labels=["gpu_type", "node_status", "use"],
    )
    held = GaugeMetricFamily(
        "gpufleet_gpus_held",
        "GPUs promised to one waiting job: backfill reservations, and GPUs held for a "
        "preemptor (reclaim, priority).",
        labels=["gpu_type", "reason"],
    )
    nodes = GaugeMetricFamily(
        "gpufleet_nodes", "Nodes by GPU type and status.", labels=["gpu_type", "node_status"]
    )
    free = GaugeHistogramMetricFamily(
        "gpufleet_node_free_gpus",
        "Free GPUs per schedulable node (fragmentation), as a histogram over nodes.",
        labels=["gpu_type"],
    )
    fit = GaugeMetricFamily(
        "gpufleet_largest_fitting_job_gpus",
        "The most GPUs a single-node job of this type could get right now.",
        labels=["gpu_type"],
    )
    team_gpus = GaugeMetricFamily(
        "gpufleet_team_gpus",
        "GPUs per team and type: allocated, guaranteed, borrowed (allocated above the guarantee).",
        labels=["team", "gpu_type", "kind"],
    )
    share = GaugeMetricFamily(
        "gpufleet_team_dominant_share_ratio",
        "Weighted dominant share of each team (DRF): its largest share of any GPU type, CPU "
        "or memory, divided by its weight.",
        labels=["team"],
    )
    usage = GaugeMetricFamily(
        "gpufleet_team_usage_gpu_seconds",
        "Charged usage of each team in GPU-seconds, exponentially decayed (policy.usage).",
        labels=["team"],
    )
    weight = GaugeMetricFamily(
        "gpufleet_team_weight", "Fair-share weight of each team.", labels=["team"]
    )
    pending = GaugeMetricFamily(
        "gpufleet_scheduler_pending_jobs", "Jobs the last scheduling pass considered."
    )
    if view is not None:
        for k, n in sorted(view.queue_depth.items()):
            depth.add_metric(list(k), n)
        for k, ages in sorted(view.queue_age.items()):
            buckets, total = _buckets(ages, AGE_BUCKETS_S)
            age.add_metric(list(k), buckets, total)
        for k3, n in sorted(view.gpus.items()):
            gpus.add_metric(list(k3), n)
        for k2, n in sorted(view.held.items()):
            held.add_metric(list(k2), n)
        for k2, n in sorted(view.nodes.items()):
            nodes.add_metric(list(k2), n)
        for t, frees in sorted(view.free_per_node.items()):
            buckets, total = _buckets([float(f) for f in frees], FREE_GPU_BUCKETS)
            free.add_metric([t], buckets, total)
        for t, n in sorted(view.largest_fit.items()):
            fit.add_metric([t], n)
        for k3, team_held in sorted(view.team_gpus.items()):
            team_gpus.add_metric(list(k3), team_held)
        for t, v in sorted(view.team_share.items()):
            share.add_metric([t], v)
        for t, v in sorted(view.team_usage.items()):
            usage.add_metric([t], v)
        for t, v in sorted(view.team_weight.items()):
            weight.add_metric([t], v)
        pending.add_metric([], view.pending)
    yield from (depth, age, gpus, held, nodes, free, fit, team_gpus, share, usage, weight)
    yield pending


def _budget_metrics(budgets: Mapping[tuple[str, str], BudgetStatus]) -> Iterator[Metric]:
    """Each team budget's used fraction, use and size (labels: team, budget key such as
    ``gpu:*:month`` or ``class:CRITICAL``, and ``mode``: hard or soft; a class budget's
    demote or hold), as ``GET /v1/usage``'s ``budgets`` says them."""
    labels = ["team", "budget", "mode"]
    ratio = GaugeMetricFamily(
        "gpufleet_team_budget_used_ratio",
        "Used fraction of each team GPU-hour budget in its current period or window (ended "
        "attempts from the ledger plus the running ones); soft budgets warn at 0.8 and 1, "
        "hard ones hold new jobs at 1.",
        labels=labels,
    )
    used = GaugeMetricFamily(
        "gpufleet_team_budget_used_gpu_hours",
        "GPU-hours used of each team budget in its current period or window.",
        labels=labels,
    )
    limit = GaugeMetricFamily(
        "gpufleet_team_budget_limit_gpu_hours",
        "GPU-hours of each team budget per period or window.",
        labels=labels,
    )
    for (team, key), b in sorted(budgets.items()):
        if b.priority is not None:  # a class budget: what a job over it gets
            mode = "hold" if b.hard else "demote"
        else:
            mode = "hard" if b.hard else "soft"
        lv = [team, key, mode]
        ratio.add_metric(lv, b.fraction if b.limit_gpu_h > 0 else 1.0)
        used.add_metric(lv, b.used_gpu_h)
        limit.add_metric(lv, b.limit_gpu_h)
    yield from (ratio, used, limit)


def _buckets(
    values: Sequence[float], bounds: Sequence[float]
) -> tuple[list[tuple[str, float]], float]:
    """Cumulative ``(le, count)`` pairs (``+Inf`` last) and the sum of ``values``."""
    ordered = sorted(values)
    out: list[tuple[str, float]] = []
    i = 0
    for b in bounds:
        while i < len(ordered) and ordered[i] <= b:
            i += 1
        out.append((_le(b), float(i)))
    out.append(("+Inf", float(len(ordered))))
    return out, float(sum(ordered))


def _le(b: float) -> str:
    return str(float(b))


def count_waste(snap: ClusterSnapshot, decision: Preempt) -> None:
    """Count the work ``decision``'s victims lose (``PREEMPTION_WASTE``), priced at the
    pass's clock from the snapshot's attempts (a victim not in it is not counted)."""
    victims = set(decision.victim_run_ids)
    for r in snap.running:
        if r.run_id in victims:
            PREEMPTION_WASTE.labels(r.team_id).inc(lost_gpu_h(r, snap.now_s))


def _register() -> None:
    with contextlib.suppress(ValueError):  # a module reload in one process
        REGISTRY.register(FleetCollector())


_register()
