"""The leader's incremental scheduling snapshot: read everything once, then per pass only the
rows that changed since the previous pass.

``load_snapshot`` reads every pending job, running attempt and node on every pass (about
10,000 + 1,000 rows at the production scale). :class:`SnapshotCache` keeps those rows, as the
policy's values, in leader memory, and asks the database only for the rows whose
``change_seq`` (set by triggers, migration 0006s, on every insert and on every update of a
column listed in :data:`WATCHED`) is at or above the *floor* taken in the previous pass's
snapshot (``dialect.change_floor``). Per-team queues are kept sorted by
``policy.priority.queue_key`` and handed to the policy as ``ClusterSnapshot.queues``, so a pass
neither re-reads nor re-sorts 10,000 jobs.

Teams and GPU holds are small and read in full every pass; node deletions are noticed by a
count of ``node_capacity``. Gates (``store.gating``) are applied by the caller as before.

Correctness first: the cache rebuilds from scratch (the same reads as a first pass) when it is
new, when the leader epoch changes, after any error while refreshing (the caller calls
:meth:`SnapshotCache.invalidate`), when the database server restarted or failed over
(PostgreSQL's start time changed), when the change triggers are missing (a table rebuilt by a
later SQLite migration loses its triggers: then every pass is a full read, and an error is
logged), and at least every ``full_every_s`` seconds of database time. A test checks that the
incremental snapshot equals ``load_snapshot`` after random sequences of writes.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, text
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter

from gpufleet.domain.states import JobStatus, ReservationStatus, RunStatus
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.fleet_index import FleetIndex
from gpufleet.policy.limits import TeamLimits
from gpufleet.policy.priority import QueueKey, queue_key
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
from gpufleet.store.dialect import change_floor, change_floor_sql, change_triggers_present
from gpufleet.store.predictions import HistoryPredictor
from gpufleet.store.queries import (
    RUNNING_COLUMNS,
    SpecCache,
    SpecFacts,
    failed_start_nodes,
    handshake_savings,
    kept_back,
    node_state,
    pending_job,
    recent_displacements,
    running_job,
    spec_facts,
)
from gpufleet.store.tables import (
    GpuHoldRow,
    JobRow,
    JobRunRow,
    NodeCapacityRow,
    NodeRow,
    ReservationRow,
    TeamRow,
)
from gpufleet.store.team_limits import limits_from_json

log = logging.getLogger("gpufleet.store.snapshot_cache")

WATCHED: dict[str, tuple[str, ...]] = {
    "jobs": (
        "status",
        "cancel_requested",
        "retry_after",
        "priority",
        "queued_at",
        "attempts",
        "max_runtime_s",
        "team_id",
        "created_at",
        "gpu_count",
        "spec",
    ),
    "job_runs": (
        "status",
        "node_id",
        "gpu_ids",
        "started_at",
        "created_at",
        "preempted_for_job_id",
        "rank",
        "gang_size",
        "last_checkpoint_at",
    ),
    "reservations": ("status", "created_at", "run_id"),
    "nodes": (
        "status",
        "gpu_type",
        "gpu_memory_mb",
        "cpu",
        "memory_mb",
        "labels",
        "admin_labels",
        "images",
    ),
    "node_capacity": ("total_gpus", "available_gpus"),
}
"""Per table, the columns whose change bumps ``change_seq`` (the newest migration's list,
0008c): every column this module reads, except immutable ids."""

LIVE_RUN = (RunStatus.ASSIGNED, RunStatus.RUNNING, RunStatus.PREEMPTING)
ACTIVE_RESERVATION = (ReservationStatus.RESERVED, ReservationStatus.CONFIRMED)
CHUNK = SpecCache.CHUNK

_PENDING_COLUMNS = (
    JobRow.id,
    JobRow.team_id,
    JobRow.priority,
    JobRow.created_at,
    JobRow.queued_at,
    JobRow.attempts,
    JobRow.max_runtime_s,
    JobRow.retry_after,
    JobRow.status,
    JobRow.cancel_requested,
    JobRow.name,
    JobRow.submitted_by,
    JobRow.gpu_count,
)
_RUN_COLUMNS = (
    *RUNNING_COLUMNS,
    ReservationRow.status.label("reservation_status"),
    ReservationRow.created_at.label("reserved_at"),
)
_NODE_COLUMNS = (
    NodeRow.id,
    NodeRow.gpu_type,
    NodeRow.gpu_memory_mb,
    NodeRow.cpu,
    NodeRow.memory_mb,
    NodeRow.labels,
    NodeRow.admin_labels,
    NodeRow.status,
    NodeRow.images,
    # not WATCHED: an agent's new --gpu-sharing mode is seen by the next full read
    # (``full_every_s``) or the node's next watched change; shares placed stay either way
    NodeRow.gpu_sharing,
    # not WATCHED (a heartbeat must not make the node's row change each second): read only
    # for a SUSPECT node's silence, and a silent node's last heartbeat stays what it was
    # when it went SUSPECT (a status change, watched: the row is read again then)
    NodeRow.last_heartbeat_at,
    NodeCapacityRow.total_gpus,
    NodeCapacityRow.available_gpus,
)


# Built once: constructing a Select costs more than running these small queries on SQLite.
_IDS: BindParameter[list[str]] = bindparam("ids", expanding=True)
_NODES = select(*_NODE_COLUMNS).join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
_NODES_BY_ID = _NODES.where(NodeRow.id.in_(_IDS))
_CHANGED_JOBS = select(*_PENDING_COLUMNS).where(JobRow.change_seq >= bindparam("floor"))
_RUNS_OF_JOBS = (
    select(*_RUN_COLUMNS)
    .join(JobRow, JobRow.id == JobRunRow.job_id)
    .outerjoin(ReservationRow, ReservationRow.run_id == JobRunRow.id)
    .where(JobRunRow.job_id.in_(_IDS))
)
_SPECS = select(JobRow.id, JobRow.spec).where(JobRow.id.in_(_IDS))
_TEAMS = select(
    TeamRow.id,
    TeamRow.weight,
    TeamRow.guaranteed_gpus,
    TeamRow.borrow_limit_gpus,
    TeamRow.lending_limit_gpus,
    TeamRow.usage_gpu_s,
    TeamRow.usage_as_of,
    TeamRow.limits,
)
_HOLDS = select(
    GpuHoldRow.job_id,
    GpuHoldRow.node_id,
    GpuHoldRow.gpu_count,
    GpuHoldRow.since,
    GpuHoldRow.reason,
).order_by(GpuHoldRow.job_id, GpuHoldRow.node_id)


@dataclass
class RefreshStats:
    """What the last :meth:`SnapshotCache.load` did (for logs, metrics and benchmarks)."""

    full: bool = False
    reason: str = ""
    jobs: int = 0
    """Job rows read (changed, or all of them on a full read)."""
    runs: int = 0
    nodes: int = 0


@dataclass
class _Team:
    """One team's pending jobs: eligible ones sorted by the queue key, and a frozen copy
    handed to the policy (made again only after the queue changed)."""

    queue: list[PendingJob] = field(default_factory=list)
    frozen: tuple[PendingJob, ...] | None = None


class SnapshotCache:
    """The scheduler's snapshot, kept in leader memory and refreshed from changed rows.

    Args:
        config: the policy configuration (its ``ordering`` gives the queue sort key).
        full_every_s: rebuild from scratch at least this often (database clock), as a safety
            net against anything the change sequence could miss.
    """

    def __init__(
        self,
        config: PolicyConfig | None = None,
        *,
        full_every_s: float = 60.0,
        fence_after_s: float | None = None,
    ) -> None:
        self._key: Callable[[PendingJob], QueueKey] = queue_key(config or PolicyConfig())
        self.full_every_s = full_every_s
        self.fence_after_s = fence_after_s
        """A silent node's time to its fence (``store.queries.node_state``), seconds."""
        self.stats = RefreshStats()
        self._floor: int | None = None
        self._server: str | None = None
        self._epoch: int | None = None
        self._built_at_s = 0.0
        self._predictions: HistoryPredictor | None = None
        self._predicted_at = -1  # HistoryPredictor.observed when predictions were applied
        self._reset()

    def _reset(self) -> None:
        self._facts: dict[str, SpecFacts] = {}
        # every PENDING job without a cancel request: (retry_after, job); the eligible ones
        # (no backoff left) are also in their team's sorted queue
        self._pending: dict[str, tuple[datetime | None, PendingJob]] = {}
        self._queued: set[str] = set()
        self._backoff: set[str] = set()
        self._teams: dict[str, _Team] = {}
        self._limits_parsed: dict[str, tuple[Any, TeamLimits]] = {}
        # every team's ``teams.limits`` as of the last load (teams with none left out), read
        # with the teams' other columns (the scheduler's limits step)
        self.team_limits: dict[str, TeamLimits] = {}
        self._nodes: dict[str, NodeState] = {}
        self._fleet: FleetIndex | None = None
        """Free lists and static facts of ``_nodes``, kept across passes as the simulator
        keeps its own (``ClusterSnapshot.fleet_index``): changed nodes are re-indexed one by
        one; None (made again at the next snapshot) after a node came or went."""
        self._runs: dict[str, RunningJob] = {}
        self._reserved_at_s: dict[str, float] = {}
        self._runs_of_job: dict[str, set[str]] = {}
        # what a prediction is keyed on, per job: (team, submitter, name, GPU count)
        self._pkeys: dict[str, tuple[str, str | None, str | None, int]] = {}

    def invalidate(self) -> None:
        """Make the next :meth:`load` a full read (after an error, or any doubt)."""
        self._floor = None

    def load(
        self,
        session: Session,
        now: datetime,
        *,
        epoch: int = 0,
        reservations: tuple[BackfillReservation, ...] = (),
        usage_half_life_s: float = 7 * 24 * 3600.0,
        predictions: HistoryPredictor | None = None,
        displacement_window_s: float = 6 * 3600.0,
    ) -> ClusterSnapshot:
        """The snapshot of one pass, as ``store.queries.load_snapshot`` would read it, with
        ``pending`` empty and the jobs in ``queues`` (call inside ``Database.snapshot()``,
        after ``db_now``, so that every read sees one moment).

        Args:
            now: the database clock read in this snapshot.
            epoch: the leader epoch of this pass; a change forces a full read.
            reservations: the backfill reservations of the previous pass.
            usage_half_life_s: decay of charged usage (``policy.usage``).
            predictions: the leader's duration predictor (``store.predictions``): fills
                ``predicted_duration_s``; when it learned something since the last pass,
                every cached job's prediction is recomputed (None: no predictions).
            displacement_window_s: how far back preempted runs are read as
                ``recent_displacements`` (``store.queries.recent_displacements``), seconds.
        """
        if predictions is not self._predictions:
            self._predictions, self._predicted_at = predictions, -1
            self._floor = None  # jobs already cached carry the other predictor's values
        now_s = now.timestamp()
        prev, self._floor = self._floor, None  # set again only once this refresh succeeded
        reason = ""
        if prev is None:
            reason = "first pass" if self._epoch is None else "invalidated"
        elif epoch != self._epoch:
            reason = "leader epoch changed"
        elif now_s - self._built_at_s >= self.full_every_s or now_s < self._built_at_s:
            reason = "periodic"
        floor: int | None = None
        if prev is not None and not reason:
            floor, server, changes = self._changes(session, prev)
            if server != self._server:
                reason = "database server restarted"  # or failed over to a replica
            elif floor < prev:
                reason = "change sequence went back"  # a restored or replaced database
        if reason:
            floor, self._server = change_floor(session)
            if not change_triggers_present(session, tuple(WATCHED)):
                log.error("change_seq triggers missing (migration 0006s): full reads every pass")
                reason += " (no triggers)"
                floor = None
            self.stats = RefreshStats(full=True, reason=reason)
            self._reset()
            self._full(session)
            self._built_at_s = now_s
        else:
            self.stats = RefreshStats()
            self._incremental(session, prev, changes)  # type: ignore[arg-type]
        self._epoch = epoch
        self._repredict()
        self._release_backoff(now)
        snap = self._snapshot(
            session,
            now,
            now_s,
            reservations,
            usage_half_life_s,
            recent_displacements(session, now, displacement_window_s),
        )
        self._floor = floor
        return snap

    @property
    def queued(self) -> Container[str]:
        """The ids of the jobs in the queues of the last :meth:`load`'s snapshot (valid until
        the next ``load``)."""
        return self._queued

    def pending_jobs(self, job_ids: Iterable[str]) -> dict[str, PendingJob]:
        """The cached PendingJob of each of ``job_ids`` that is pending (as of the last
        :meth:`load`)."""
        out = {}
        for job_id in job_ids:
            entry = self._pending.get(job_id)
            if entry is not None:
                out[job_id] = entry[1]
        return out

    def prediction_key(self, job_id: str) -> tuple[str, str | None, str | None, int] | None:
        """What the prediction of a cached pending or running job is keyed on: (team,
        submitter, name, GPU count); None for a job the cache does not hold."""
        return self._pkeys.get(job_id)

    # -- reads ---------------------------------------------------------------------------
    def _full(self, session: Session) -> None:
        self._read_nodes(session, None)
        self._read_pending(session, None)
        live = session.execute(
            select(JobRunRow.job_id).where(JobRunRow.status.in_(LIVE_RUN))
        ).scalars()
        held = session.execute(
            select(ReservationRow.job_id).where(ReservationRow.status.in_(ACTIVE_RESERVATION))
        ).scalars()
        self._read_runs(session, {*live, *held})

    @staticmethod
    def _changes(session: Session, prev: int) -> tuple[int, str, dict[str, set[str]]]:
        """This snapshot's floor and server incarnation, the nodes and the jobs whose attempts
        changed at or after ``prev``, and the number of nodes, in one statement (a round trip
        costs more than these index range scans)."""
        floor_sql, server_sql = change_floor_sql(session)
        rows = session.execute(
            text(
                f"SELECT 'floor', CAST({floor_sql} AS VARCHAR(40)) "
                f"UNION ALL SELECT 'server', CAST({server_sql} AS VARCHAR(64)) "
                "UNION ALL SELECT 'count', CAST(count(*) AS VARCHAR(40)) FROM node_capacity "
                "UNION ALL SELECT 'node', id FROM nodes WHERE change_seq >= :f "
                "UNION ALL SELECT 'node', node_id FROM node_capacity WHERE change_seq >= :f "
                "UNION ALL SELECT 'run', job_id FROM job_runs WHERE change_seq >= :f "
                "UNION ALL SELECT 'run', job_id FROM reservations WHERE change_seq >= :f"
            ),
            {"f": prev},
        ).all()
        out: dict[str, set[str]] = {
            "floor": set(),
            "server": set(),
            "count": set(),
            "node": set(),
            "run": set(),
        }
        for kind, key in rows:
            out[kind].add(key)
        return int(out.pop("floor").pop()), out.pop("server").pop(), out

    def _incremental(self, session: Session, floor: int, changes: dict[str, set[str]]) -> None:
        jobs = self._read_nodes(session, changes["node"])
        if int(next(iter(changes["count"]))) != len(self._nodes):
            # a node was deleted: read the nodes again
            self._nodes = {}
            self._fleet = None
            jobs |= self._read_nodes(session, None)
        jobs |= self._read_pending(session, floor)
        jobs |= changes["run"]
        self._read_runs(session, jobs)

    def _read_nodes(self, session: Session, ids: set[str] | None) -> set[str]:
        """Read nodes (all when ``ids`` is None); returns the jobs whose attempts must be read
        again because their node's GPU type changed or the node went away."""
        rows: list[Any] = []
        if ids is None:
            rows = list(session.execute(_NODES))
        else:
            ordered = sorted(ids)
            for start in range(0, len(ordered), CHUNK):
                chunk = ordered[start : start + CHUNK]
                rows += session.execute(_NODES_BY_ID, {"ids": chunk}).all()
        self.stats.nodes += len(rows)
        retyped: set[str] = set()
        seen = set()
        for n in rows:
            seen.add(n.id)
            old = self._nodes.get(n.id)
            node = node_state(n, self.fence_after_s)
            if old is None or old.gpu_type != node.gpu_type:
                retyped.add(n.id)
            self._nodes[n.id] = node
            if self._fleet is not None:
                if old is None:
                    self._fleet = None  # a new node: index them all again (in their order)
                else:
                    self._fleet.update(node)
        if ids is not None:
            for gone in ids - seen:
                if self._nodes.pop(gone, None) is not None:
                    self._fleet = None
                retyped.add(gone)
        if not retyped or not self._runs:
            return set()
        return {r.job_id for r in self._runs.values() if r.node_id in retyped}

    def _read_pending(self, session: Session, floor: int | None) -> set[str]:
        """Read PENDING jobs (all of them when ``floor`` is None, else every job changed at or
        after ``floor``, whatever its status); returns the ids of the jobs read."""
        if floor is None:
            query = select(*_PENDING_COLUMNS).where(
                JobRow.status == JobStatus.PENDING, JobRow.cancel_requested.is_(False)
            )
            rows = session.execute(query).all()
        else:
            rows = session.execute(_CHANGED_JOBS, {"floor": floor}).all()
        self.stats.jobs += len(rows)
        # a changed PENDING job's spec is read again: PATCH may change its GPUs (a watched
        # change of gpu_count or spec, migration 0012_day26)
        new = [
            r.id
            for r in rows
            if (floor is not None or r.id not in self._facts)
            and r.status == JobStatus.PENDING
            and not r.cancel_requested
        ]
        self._lookup_facts(session, new)
        avoid = failed_start_nodes(
            session,
            (r for r in rows if r.status == JobStatus.PENDING and not r.cancel_requested),
        )
        for row in rows:
            self._drop_pending(row.id)
            if row.status != JobStatus.PENDING or row.cancel_requested:
                continue
            facts = self._facts[row.id]
            job = pending_job(
                row,
                facts,
                self._predict(row.id, (row.team_id, row.submitted_by, row.name, row.gpu_count)),
                avoid.get(row.id),
            )
            self._pending[row.id] = (row.retry_after, job)
            if row.retry_after is None:
                self._enqueue(job)
            else:
                self._backoff.add(row.id)  # queued by _release_backoff once it is due
        return {r.id for r in rows}

    def _read_runs(self, session: Session, job_ids: Iterable[str]) -> None:
        """Read every attempt member of ``job_ids`` that is live or holds an active
        reservation, replacing what the cache had for those jobs."""
        ordered = sorted(set(job_ids))
        if not ordered:
            return
        rows: list[Any] = []
        for start in range(0, len(ordered), CHUNK):
            chunk = ordered[start : start + CHUNK]
            rows += session.execute(_RUNS_OF_JOBS, {"ids": chunk}).all()
        rows = [
            r for r in rows if r.status in LIVE_RUN or r.reservation_status in ACTIVE_RESERVATION
        ]
        self.stats.runs += len(rows)
        for job_id in ordered:
            for run_id in self._runs_of_job.pop(job_id, ()):
                self._runs.pop(run_id, None)
                self._reserved_at_s.pop(run_id, None)
        self._lookup_facts(session, [r.job_id for r in rows if r.job_id not in self._facts])
        stopping_for = {r.job_id: r.preempted_for_job_id for r in rows if r.status == "PREEMPTING"}
        later = [r.job_id for r in rows if r.attempt > 1]  # (a first attempt had no stop)
        saves = handshake_savings(session, later) if later else {}
        for run in rows:
            self._runs[run.id] = running_job(
                run,
                self._facts[run.job_id],
                self._nodes[run.node_id].gpu_type if run.node_id in self._nodes else "",
                live=run.status in LIVE_RUN,
                stopping_for=stopping_for,
                predicted_s=self._predict(
                    run.job_id, (run.team_id, run.submitted_by, run.name, run.gpu_count)
                ),
                handshake_saves_s=saves.get(run.job_id, 0.0),
            )
            self._runs_of_job.setdefault(run.job_id, set()).add(run.id)
            if run.reservation_status in ACTIVE_RESERVATION:
                self._reserved_at_s[run.id] = run.reserved_at.timestamp()
        # facts of jobs neither pending nor running any more are not needed again
        for job_id in ordered:
            if job_id not in self._pending and job_id not in self._runs_of_job:
                self._facts.pop(job_id, None)

    def _lookup_facts(self, session: Session, job_ids: Sequence[str]) -> None:
        for start in range(0, len(job_ids), CHUNK):
            chunk = job_ids[start : start + CHUNK]
            for job_id, spec in session.execute(_SPECS, {"ids": chunk}):
                self._facts[job_id] = spec_facts(spec)

    # -- predictions ---------------------------------------------------------------------
    def _predict(self, job_id: str, key: tuple[str, str | None, str | None, int]) -> float | None:
        self._pkeys[job_id] = key
        p = self._predictions
        return p.predict_s(*key) if p is not None else None

    def _repredict(self) -> None:
        """After the predictor learned (it refreshes every few seconds, not every pass):
        recompute every cached job's prediction, and re-sort the queues it changed (an
        ordering such as QSSF sorts by it)."""
        p = self._predictions
        if p is None or p.observed == self._predicted_at:
            return
        self._predicted_at = p.observed
        live = set(self._pending) | set(self._runs_of_job)
        self._pkeys = {k: v for k, v in self._pkeys.items() if k in live}
        touched: set[str] = set()
        for job_id, (retry_after, job) in list(self._pending.items()):
            new = p.predict_s(*self._pkeys[job_id])
            if new != job.predicted_duration_s:
                self._pending[job_id] = (retry_after, replace(job, predicted_duration_s=new))
                if job_id in self._queued:
                    touched.add(job.team_id)
        for team_id in touched:
            team = self._teams[team_id]
            team.queue = sorted((self._pending[j.job_id][1] for j in team.queue), key=self._key)
            team.frozen = None
        for run_id, run in list(self._runs.items()):
            new = p.predict_s(*self._pkeys[run.job_id])
            if new != run.predicted_duration_s:
                self._runs[run_id] = replace(run, predicted_duration_s=new)

    # -- queues --------------------------------------------------------------------------
    def _enqueue(self, job: PendingJob) -> None:
        team = self._teams.setdefault(job.team_id, _Team())
        bisect.insort(team.queue, job, key=self._key)
        team.frozen = None
        self._queued.add(job.job_id)

    def _drop_pending(self, job_id: str) -> None:
        entry = self._pending.pop(job_id, None)
        if entry is None:
            return
        job = entry[1]
        self._backoff.discard(job_id)
        if job_id not in self._queued:
            return
        self._queued.discard(job_id)
        team = self._teams[job.team_id]
        q = team.queue
        i = bisect.bisect_left(q, self._key(job), key=self._key)
        assert q[i].job_id == job_id, "queue out of order"
        del q[i]
        team.frozen = None
        if not q:
            del self._teams[job.team_id]

    def _release_backoff(self, now: datetime) -> None:
        """Queue the jobs whose retry backoff ended (``retry_after <= now``, as the full
        read's filter)."""
        if not self._backoff:
            return
        for job_id in sorted(self._backoff):
            retry_after, job = self._pending[job_id]
            if retry_after is not None and retry_after <= now:
                self._backoff.discard(job_id)
                self._enqueue(job)

    # -- the snapshot --------------------------------------------------------------------
    def _snapshot(
        self,
        session: Session,
        now: datetime,
        now_s: float,
        reservations: tuple[BackfillReservation, ...],
        usage_half_life_s: float,
        displacements: tuple[Displacement, ...],
    ) -> ClusterSnapshot:
        running_by_team: dict[str, list[tuple[float, float]]] = {}
        for r in self._runs.values():
            since = self._reserved_at_s.get(r.run_id)
            start_s = since if since is not None else r.started_at_s
            running_by_team.setdefault(r.team_id, []).append((r.gpus, start_s))
        teams = {}
        team_limits: dict[str, TeamLimits] = {}
        for t in session.execute(_TEAMS):
            if t.limits:  # parsed again only when the stored JSON changed
                parsed = self._limits_parsed.get(t.id)
                if parsed is None or parsed[0] != t.limits:
                    parsed = self._limits_parsed[t.id] = (t.limits, limits_from_json(t.limits))
                if not parsed[1].empty:
                    team_limits[t.id] = parsed[1]
            as_of = (t.usage_as_of or now).timestamp()
            ledger = UsageLedger(t.usage_gpu_s, min(as_of, now_s), usage_half_life_s)
            teams[t.id] = TeamState(
                team_id=t.id,
                weight=t.weight,
                guaranteed_gpus=dict(t.guaranteed_gpus or {}),
                borrow_limit_gpus=t.borrow_limit_gpus,
                lending_limit_gpus=kept_back(t.guaranteed_gpus or {}, t.lending_limit_gpus or {}),
                usage_gpu_s=ledger.with_running(now_s, running_by_team.get(t.id, [])),
            )
        self.team_limits = team_limits
        holds = tuple(
            GpuHold(h.job_id, h.node_id, h.gpu_count, h.since.timestamp(), h.reason)
            for h in session.execute(_HOLDS)
        )
        queues: dict[str, tuple[PendingJob, ...]] = {}
        for team_id, team in self._teams.items():
            if team.frozen is None:
                team.frozen = tuple(team.queue)
            queues[team_id] = team.frozen
        if self._fleet is None:
            self._fleet = FleetIndex(self._nodes.values())
        return ClusterSnapshot(
            now_s=now_s,
            nodes=tuple(self._nodes.values()),
            pending=(),
            running=tuple(self._runs.values()),
            teams=teams,
            holds=holds,
            reservations=reservations,
            queues=queues,
            recent_displacements=displacements,
            fleet_index=self._fleet,
        )


def pending_of(snap: ClusterSnapshot) -> Iterable[PendingJob]:
    """The pending jobs of a snapshot, whether it lists them in ``pending`` or ``queues``."""
    if snap.queues is None:
        return snap.pending
    return (j for q in snap.queues.values() for j in q)
