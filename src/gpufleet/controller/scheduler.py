"""The scheduler pass (leader only): snapshot -> ``policy.schedule`` -> apply each decision.

Holds :class:`Scheduler` (its pass, the reservation of each Place/PlaceGang, preemptions, and
the ``pending_reason`` rows of waiting jobs), :class:`PassStats` and :func:`reason_json`.
Sending AssignJob for what a pass reserved is :mod:`gpufleet.controller.dispatch`.

The pass reads a short snapshot, decides outside any transaction, and applies each decision
in its own short transaction guarded by the leader epoch and the attempt's token. RPCs to
agents happen only after commit.
"""

from __future__ import annotations

import logging
import time
from collections import ChainMap
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cache, partial
from typing import Any, cast

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from gpufleet.controller import metrics
from gpufleet.controller.agents import AgentClients
from gpufleet.controller.dispatch import AssignmentDispatch
from gpufleet.controller.leadership import Leadership
from gpufleet.controller.rpc_errors import loop_failed
from gpufleet.controller.stops import StopDriver, send_stop
from gpufleet.domain.errors import CapacityConflict, NotLeader, StaleState
from gpufleet.domain.states import JobStatus
from gpufleet.objectstore import ObjectStore
from gpufleet.policy import limits
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import (
    CycleResult,
    Decision,
    HoldForBackfill,
    Place,
    PlaceGang,
    Preempt,
    WaitReason,
)
from gpufleet.policy.ordering import displacement_window_s
from gpufleet.policy.predictor import Spread
from gpufleet.policy.snapshot import BackfillReservation, ClusterSnapshot
from gpufleet.policy.start_estimate import StartEstimate, estimate_starts
from gpufleet.services import preemption
from gpufleet.services.jobs import iso
from gpufleet.settings import Settings
from gpufleet.store import allocate, gating
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.predictions import HistoryPredictor
from gpufleet.store.preemption_waste import waste_state
from gpufleet.store.snapshot_cache import SnapshotCache
from gpufleet.store.tables import JobRow, NodeRow
from gpufleet.store.team_limits import LEDGER_REFRESH_S, ledger_use
from gpufleet.store.transitions import record_event

log = logging.getLogger("gpufleet.controller")


@dataclass
class PassStats:
    pending: int = 0
    placed: int = 0
    preempted: int = 0
    conflicts: int = 0
    seconds: float = 0.0
    placed_runs: list[str] = field(default_factory=list)
    applied: list[Decision] = field(default_factory=list)
    """Decisions committed in this pass (for the metrics)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds (wall, ``time.perf_counter``) per phase of the pass: ``read`` (snapshot,
    gates, limits), ``policy`` (``policy.schedule``), ``apply`` (reservations, preemptions,
    holds), ``estimate`` (start estimates, when recomputed), ``reasons`` (pending reasons
    written), ``metrics``; for benchmarks/leader_pass.py and logs."""


def _at(t: float | None) -> str | None:
    return iso(datetime.fromtimestamp(t, UTC)) if t is not None else None


def estimate_json(est: StartEstimate) -> dict[str, object]:
    """The stored and served form of a start estimate (``pending_reason.start_estimate``):
    ``earliest_at``/``latest_at`` (ISO 8601 UTC, the p10..p90 start; None when unknown),
    ``ahead``, ``basis``, ``unknown`` (why there is no range, or None), ``reserved``."""
    return {
        "earliest_at": _at(est.earliest_s),
        "latest_at": _at(est.latest_s),
        "ahead": est.ahead,
        "basis": est.basis,
        "unknown": est.unknown,
        "reserved": est.reserved,
    }


def reason_json(
    reason: WaitReason, now_s: float, estimate: dict[str, object] | None = None
) -> dict[str, object]:
    """The stored and served form of a wait reason (``pending_reason``); ``estimate``: the
    job's ``estimate_json`` (None: none computed yet)."""
    est = reason.estimated_start_s
    return {
        "code": reason.code,
        "message": reason.message,
        "details": dict(reason.details),
        "position": reason.position,
        "estimated_start_at": iso(datetime.fromtimestamp(est, UTC))
        if est is not None and est >= now_s
        else None,
        "start_estimate": estimate,
    }


def _estimate_changed(old: object, new: dict[str, object] | None, now_s: float) -> bool:
    """Whether a stored start estimate is worth rewriting: its words or jobs ahead changed,
    or an end of its range moved by more than ``ESTIMATE_SLACK_S`` and a tenth of the wait."""
    if not isinstance(old, dict) or new is None:
        return (old is None) != (new is None)
    if any(old.get(k) != new.get(k) for k in ("ahead", "basis", "unknown", "reserved")):
        return True
    for k in ("earliest_at", "latest_at"):
        a, b = old.get(k), new.get(k)
        if not isinstance(a, str) or not isinstance(b, str):
            if a != b:
                return True
            continue
        ta = datetime.fromisoformat(a.replace("Z", "+00:00")).timestamp()
        tb = datetime.fromisoformat(b.replace("Z", "+00:00")).timestamp()
        if abs(ta - tb) > max(ESTIMATE_SLACK_S, 0.1 * max(0.0, tb - now_s)):
            return True
    return False


ESTIMATE_SLACK_S = 30.0
RESERVE_THREADS = 4
"""Connections that reserve one pass's placements on different nodes concurrently
(``Scheduler._place_batch``; PostgreSQL only: SQLite admits one writer at a time)."""
REASONS_REFRESH_S = 2.0
START_ESTIMATE_REFRESH_S = 10.0
"""How often the leader recomputes every waiting job's start estimate
(``policy.start_estimate``; ~0.4 s of CPU at 10,000 pending x 1,000 nodes:
docs/design/scheduling-policy.md)."""
PREDICTION_REFRESH_S = 10.0
"""How often the leader reads the attempts that finished since it last looked (one indexed
query on ``usage_records``) into its duration predictor."""


def _estimate_moved(old_iso: object, reason: WaitReason, now_s: float) -> bool:
    new = (
        reason.estimated_start_s
        if reason.estimated_start_s and reason.estimated_start_s >= now_s
        else None
    )
    if not isinstance(old_iso, str) or new is None:
        return (old_iso is None) != (new is None)
    old = datetime.fromisoformat(old_iso.replace("Z", "+00:00")).timestamp()
    return abs(old - new) > ESTIMATE_SLACK_S


def _job_ids(decisions: Iterable[Decision]) -> list[str]:
    """The pending jobs named by a pass's decisions."""
    return [
        d.for_job_id if isinstance(d, Preempt) else d.job_id
        for d in decisions
        if isinstance(d, (Place, PlaceGang, Preempt, HoldForBackfill))
    ]


@cache
def _store_reason() -> Any:
    """``pending_reason`` of a PENDING job, built once (``p_id``, ``p_reason``), for one
    executemany per pass."""
    jobs = cast(Table, JobRow.__table__)
    return (
        update(jobs)
        .where(
            jobs.c.id == bindparam("p_id", type_=jobs.c.id.type),
            jobs.c.status == JobStatus.PENDING,
        )
        .values(pending_reason=bindparam("p_reason", type_=jobs.c.pending_reason.type))
    )


class Scheduler(AssignmentDispatch):
    """One pass: snapshot -> ``policy.schedule`` -> reserve each Place -> AssignJob (after
    commit).

    ``dispatch`` (AssignJob after commit, in the assign pool) comes from
    :class:`~gpufleet.controller.dispatch.AssignmentDispatch`."""

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        settings: Settings,
        leadership: Leadership,
        agents: AgentClients,
        policy: PolicyConfig | None = None,
        *,
        background: bool = False,
    ) -> None:
        """``background``: write the pending reasons and compute the start estimates on a
        thread of their own, off the pass's critical path (the controller's leader does);
        False (tests, benchmarks' "before"): inside :meth:`run_pass`, as they return."""
        self.db, self.store, self.settings = db, store, settings
        self.leadership, self.agents = leadership, agents
        self.policy = policy or PolicyConfig()
        if settings.preemption_waste_gpu_h is not None:  # the fleet's waste cap (policy.waste)
            self.policy = replace(
                self.policy,
                preemption_waste_gpu_h=settings.preemption_waste_gpu_h,
                preemption_waste_window_s=settings.preemption_waste_window_s,
            )
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="assign")
        self._reserve_pool = (
            None
            if db.is_sqlite  # one writer at a time anyway
            else ThreadPoolExecutor(max_workers=RESERVE_THREADS, thread_name_prefix="reserve")
        )
        self._writer = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="reasons") if background else None
        )
        """With ``background``: ONE thread that writes each pass's pending reasons and
        computes the start estimate, in pass order (see :meth:`_store_reasons`)."""
        self._writing: (
            tuple[Future[Any], dict[str, object], dict[str, dict[str, object]]] | None
        ) = None
        """The last pass's reasons write in the background: (future, the ``stored`` map it
        updates once committed, the rows it writes); None when none is outstanding."""
        self._estimating: tuple[Future[dict[str, StartEstimate]], frozenset[str]] | None = None
        """A start estimate being computed in the background: (future, the waiting jobs of
        the pass it was computed on)."""
        self._backfill: tuple[BackfillReservation, ...] = ()
        self.predictions = HistoryPredictor()
        """Run-time predictions from finished attempts (ordering and reservations, never
        stops): warmed at this process's first pass as leader, refreshed every
        ``PREDICTION_REFRESH_S``."""
        self._predictions_read_s: float | None = None
        self._snapshots = SnapshotCache(
            self.policy,
            full_every_s=settings.scheduler_full_snapshot_every_s,
            # as the reconciler fences a silent node (waiting reasons date the fence with it)
            fence_after_s=max(
                settings.fence_timeout_s,
                settings.heartbeat_interval_s * settings.suspect_after_missed,
            ),
        )
        """The leader's incremental snapshot (``store.snapshot_cache``)."""
        self._reasons_refreshed_s = 0.0
        self._estimates: dict[str, dict[str, object]] = {}
        """Start estimate (``estimate_json``) per waiting job, as last computed."""
        self._estimated_s: float | None = None
        """``time.monotonic()`` of the last estimate (None: none yet)."""
        self.estimate_cpu_s = 0.0
        """CPU seconds of the last estimate (``time.process_time``; for metrics/benchmarks)."""
        self._stored: dict[str, object] | None = None
        self._stored_epoch = 0
        self._holding: set[str] = set()
        self._heard: set[str] = set()
        """Nodes heard from since ``_heard_since`` (this leadership's ``listening_since``)."""
        self._heard_since: datetime | None = None
        self._ledger: tuple[dict[str, limits.TeamLimits], float, Any] | None = None
        """(limits, monotonic time, ledger use) as last read (``_apply_limits``)."""
        self._ledger_runs: frozenset[str] = frozenset()
        """Running attempts of teams with a budget at the last pass (one that ended since
        makes the ledger be read again)."""
        self._demoted_now: dict[str, limits.Demotion] = {}
        self._announced: set[str] = set()
        """Jobs whose demotion this leader already recorded as an event."""
        self.budget_statuses: dict[tuple[str, str], limits.BudgetStatus] = {}
        """Every team budget at the last pass (metrics)."""
        self.stops: StopDriver | None = None
        """Sends the StopRun of preemption victims (set by the controller's wiring)."""
        """pending_reason per waiting job as this leader last wrote it (saves decoding 10k
        JSON values every pass)."""

    def run_pass(self) -> PassStats:
        t0 = time.perf_counter()
        stats = PassStats()
        if not self.leadership.is_leader:
            return stats
        try:
            with self.db.snapshot() as s:
                now = db_now(s)
                mono = time.monotonic()
                if (
                    self._predictions_read_s is None
                    or mono - self._predictions_read_s >= PREDICTION_REFRESH_S
                ):
                    if self._estimating is not None:  # it reads the predictor: not while
                        wait_futures([self._estimating[0]])  # the refresh changes it
                    self.predictions.refresh(s)
                    self._predictions_read_s = mono
                # only the rows changed since the last pass are read (a full read on the
                # first pass of each epoch, and periodically)
                snap = self._snapshots.load(
                    s,
                    now,
                    epoch=self.leadership.epoch,
                    reservations=self._backfill,
                    usage_half_life_s=self.policy.usage_half_life_s,
                    predictions=self.predictions,
                    displacement_window_s=displacement_window_s(self.policy),
                )
                # held jobs, unmet dependencies and arrays at their %N limit never reach
                # the policy
                gated = gating.gate_snapshot(s, snap, self._snapshots.queued)
                snap = self._without_unheard_nodes(s, gated.snapshot)
                # team limits (policy.limits): disallowed classes and classes over their
                # budget demoted, jobs over a hard GPU-hour budget held, for this pass only
                limited = self._apply_limits(s, snap)
                snap = limited.snapshot
                # the preemption waste caps' state (policy.waste; only when a cap is set)
                waste = waste_state(
                    s,
                    now,
                    self._snapshots.team_limits,
                    self.policy.preemption_waste_window_s
                    if self.policy.preemption_waste_gpu_h is not None
                    else None,
                )
                if waste is not None:
                    snap = replace(snap, preemption_waste=waste)
                if self._stored_epoch != self.leadership.epoch:
                    self._stored, self._stored_epoch = None, self.leadership.epoch
                if self._stored is None:  # first pass of this leader: what earlier leaders wrote
                    query = select(JobRow.id, JobRow.pending_reason).where(
                        JobRow.status == JobStatus.PENDING
                    )
                    # not dict(result): a Result has keys() and would be taken for a mapping
                    self._stored = {row[0]: row[1] for row in s.execute(query)}
        except BaseException:
            self._snapshots.invalidate()  # any doubt (a lost connection...): read it all again
            raise
        t_read = time.perf_counter()
        stats.phases["read"] = t_read - t0
        stats.pending = sum(len(q) for q in (snap.queues or {}).values()) or len(snap.pending)
        # jobs that may hold GPUs (only this leader creates holds: those of the snapshot and
        # of this pass's preemptions); placing any other job need not delete its holds
        self._holding = {h.job_id for h in snap.holds}
        if gated.result.failed:
            try:
                ended = self.db.run_write(
                    partial(gating.fail_dependents, failed=gated.result.failed, now=now)
                )
                log.info("dependency never satisfiable: %d job(s) DEPENDENCY_FAILED", len(ended))
            except SQLAlchemyError as exc:  # placements go on; the next pass tries again
                loop_failed("ending jobs with unsatisfiable dependencies", exc)
        t_policy = time.perf_counter()
        result = schedule(snap, self.policy)
        stats.phases["policy"] = time.perf_counter() - t_policy
        t_apply = time.perf_counter()
        pending = self._snapshots.pending_jobs(_job_ids(result.decisions))
        backfill: list[BackfillReservation] = []
        batch: list[Place] = []  # consecutive placements, reserved together (_place_batch)
        for decision in (*result.decisions, None):
            if isinstance(decision, Place):
                job = pending[decision.job_id]
                if (job.resources.nodes or 1) > 1:
                    # an explicit multi-node job only ever runs as a gang (PlaceGang)
                    log.warning("skip %s: job %s asks for a gang", decision, job.job_id)
                else:
                    batch.append(decision)
                continue
            if batch and not self._place_batch(batch, pending, stats):
                return stats  # lost leadership
            batch = []
            if decision is None:
                break
            try:
                if isinstance(decision, PlaceGang):
                    self._place_gang(decision, pending[decision.job_id].attempt, stats)
                elif isinstance(decision, Preempt):
                    self._preempt(decision, stats)
                    metrics.count_waste(snap, decision)
                elif isinstance(decision, HoldForBackfill):
                    backfill.append(
                        BackfillReservation(
                            decision.job_id,
                            decision.node_id,
                            decision.gpu_count,
                            decision.start_at_s,
                        )
                    )
                stats.applied.append(decision)
            except NotLeader:
                log.warning("lost leadership during a pass; stopping it")
                self.leadership.epoch = 0
                return stats
            except (CapacityConflict, StaleState) as exc:
                stats.conflicts += 1  # the world moved; the next pass sees it (assume/forget)
                log.debug("skip %s: %s", decision, exc)
        # kept in leader memory: a new leader recomputes them from scratch on its first pass
        # (the headroom shields ride along, ``CycleResult.shields``)
        self._backfill = tuple(backfill) + result.shields
        if result.released_holds or snap.holds:
            self.db.run_write(partial(preemption.release_holds, job_ids=result.released_holds))
        # a job that left the queue (placed, cancelled) is forgotten: if it comes back (a retry)
        # its reason was reset in the database and is computed again as for a new job
        waiting: Mapping[str, WaitReason] = (
            ChainMap(dict(gated.result.blocked), result.waiting)  # type: ignore[arg-type]
            if gated.result.blocked
            else result.waiting
        )
        t_est = time.perf_counter()
        stats.phases["apply"] = t_est - t_apply
        t_reasons = t_est
        if self._writing is not None and not self._writing[0].done():
            # the writer is still busy with an earlier pass's reasons (thousands of rows, a
            # pass that followed at once): this pass leaves its reasons to the next one
            # rather than wait (a waiting job's reason is at most a pass older)
            log.debug("pending reasons of this pass skipped: the writer is busy")
        else:
            self._join_writes()  # the previous pass's reasons, before this pass compares
            if limited.held or limited.demoted or limits.any_soft_warning(limited.statuses):
                waiting = self._limited_reasons(waiting, limited, snap.now_s)
            fresh = self._estimate(snap, result, waiting)
            t_reasons = time.perf_counter()
            stats.phases["estimate"] = t_reasons - t_est
            stored = {j: self._stored.get(j) for j in waiting}
            self._stored = stored
            self._store_reasons(waiting, stored, snap.now_s, fresh)
        t_metrics = time.perf_counter()
        stats.phases["reasons"] = t_metrics - t_reasons
        stats.seconds = t_metrics - t0
        metrics.observe_pass(
            snap,
            result,
            stats.applied,
            seconds=stats.seconds,
            conflicts=stats.conflicts,
            config=self.policy,
            pending_by_id=pending,
        )
        stats.phases["metrics"] = time.perf_counter() - t_metrics
        return stats

    def _estimate(
        self, snap: ClusterSnapshot, result: CycleResult, waiting: Mapping[str, WaitReason]
    ) -> bool:
        """Recompute every waiting job's start estimate, at most every
        ``START_ESTIMATE_REFRESH_S`` (the policy's own play of the queue,
        ``policy.start_estimate``, on the pass's snapshot and decisions); True when it did.
        Jobs the gates hold back get "unknown" with their reason.

        In the background (``background``): the estimate of the pass that starts it is
        computed on the writer thread, and the first pass that finds it done takes it (True
        then): the estimate is one pass older than its reasons, at most."""
        mono = time.monotonic()
        if self._writer is not None and self._estimating is not None:
            fut, estimated = self._estimating
            if not fut.done():
                return False
            self._estimating = None
            try:
                found = fut.result()
            except Exception as exc:  # the reasons go on without new estimates
                loop_failed("start estimate", exc)
                return False
            self._estimates = self._estimate_json(found, waiting, estimated)
            return True
        if self._estimated_s is not None and mono - self._estimated_s < START_ESTIMATE_REFRESH_S:
            return False
        self._estimated_s = mono
        if self._writer is not None:
            fut = self._writer.submit(self._estimate_starts, snap, result)
            self._estimating = (fut, frozenset(waiting))
            return False
        self._estimates = self._estimate_json(self._estimate_starts(snap, result), waiting)
        return True

    def _estimate_starts(
        self, snap: ClusterSnapshot, result: CycleResult
    ) -> dict[str, StartEstimate]:
        """``policy.start_estimate.estimate_starts`` on a pass's snapshot and decisions, with
        the predictor's spreads; sets ``estimate_cpu_s``. Pure but for the predictor (not
        refreshed meanwhile: ``run_pass`` waits for a background estimate first)."""
        c0 = time.process_time()
        keys, predictions = self._snapshots.prediction_key, self.predictions

        def spread(job_id: str) -> Spread | None:
            key = keys(job_id)
            return predictions.spread(*key) if key is not None else None

        found = estimate_starts(snap, result, self.policy, spread)
        self.estimate_cpu_s = time.process_time() - c0
        return found

    @staticmethod
    def _estimate_json(
        found: Mapping[str, StartEstimate],
        waiting: Mapping[str, WaitReason],
        estimated: frozenset[str] | None = None,
    ) -> dict[str, dict[str, object]]:
        """``estimate_json`` per waiting job: its estimate, or "not eligible to start yet"
        with its reason's code when the estimate left it out. ``estimated``: the waiting jobs
        of the pass the estimate was computed on (None: ``waiting``'s); a job that arrived
        since gets none (as between two estimates)."""
        out: dict[str, dict[str, object]] = {}
        for job_id in waiting:
            est = found.get(job_id)
            if est is None:
                if estimated is not None and job_id not in estimated:
                    continue
                code = waiting[job_id].code
                est = StartEstimate(None, None, 0, "", f"it is not eligible to start yet ({code})")
            out[job_id] = estimate_json(est)
        return out

    def _apply_limits(self, s: Session, snap: ClusterSnapshot) -> limits.LimitsResult:
        """``policy.limits.apply_limits`` with the teams' limits (read with the snapshot's
        teams: ``SnapshotCache.team_limits``) and the ledger's use
        (``store.team_limits.ledger_use``, read again every ``LEDGER_REFRESH_S`` or when the
        limits changed)."""
        team_limits = self._snapshots.team_limits
        self._demoted_now = {}
        if not team_limits:
            self._ledger = None
            if self.budget_statuses:
                self.budget_statuses = {}
                metrics.publish_budgets({})
            return limits.LimitsResult(snap)
        mono = time.monotonic()
        # an attempt of a budgeted team that ended since the last pass moved its use from
        # the running part (counted by the policy) into the ledger: read the ledger again,
        # or the budget would look less used until the next refresh
        budgeted = {t for t, lim in team_limits.items() if lim.class_budgets or lim.gpu_budgets}
        runs = frozenset(r.run_id for r in snap.running if r.team_id in budgeted)
        ended = not self._ledger_runs <= runs
        self._ledger_runs = runs
        if (
            self._ledger is None
            or ended
            or self._ledger[0] != team_limits
            or mono - self._ledger[1] >= LEDGER_REFRESH_S
        ):
            self._ledger = (team_limits, mono, ledger_use(s, team_limits, snap.now_s))
        out = limits.apply_limits(snap, team_limits, self._ledger[2], self.policy)
        self._demoted_now = dict(out.demoted)
        self.budget_statuses = dict(out.statuses)
        metrics.publish_budgets(self.budget_statuses)
        return out

    def _limited_reasons(
        self, waiting: Mapping[str, WaitReason], limited: limits.LimitsResult, now_s: float
    ) -> Mapping[str, WaitReason]:
        """The pass's waiting reasons with the limits' holds, and the demoted jobs' reasons
        saying so; a demotion is an event once per job and leadership."""
        over: dict[str, WaitReason] = dict(limited.held)
        for job_id, d in limited.demoted.items():
            base = waiting.get(job_id)
            if base is not None:
                over[job_id] = limits.with_demotion(base, d, now_s)
        # soft budgets at 80% / 100% warn in the waiting jobs' reasons (`why`): the
        # threshold is said, not the exact use, so a reason is not rewritten every pass
        warned = {
            t: notes
            for t in {t for t, _ in limited.statuses}
            if (notes := limits.soft_warnings(limited.statuses, t, exact=False))
        }
        if warned:
            snap = limited.snapshot
            for team_id, notes in warned.items():
                queue: Iterable[Any] = (
                    snap.queues.get(team_id, ())
                    if snap.queues is not None
                    else (j for j in snap.pending if j.team_id == team_id)
                )
                for job in queue:
                    base = over.get(job.job_id) or waiting.get(job.job_id)
                    if base is not None:
                        over[job.job_id] = replace(
                            base,
                            message=f"{base.message.rstrip('.')}; {'; '.join(notes)}",
                            details={**dict(base.details), "budget_warnings": notes},
                        )
        fresh = [d for j, d in limited.demoted.items() if j not in self._announced]
        if fresh:
            self._announced.update(d.job_id for d in fresh)

            def tx(s: Session) -> None:
                for d in fresh:
                    record_event(
                        s,
                        "priority_demoted",
                        job_id=d.job_id,
                        message=limits.demotion_note(d, now_s),
                        details={
                            "from": d.requested.value,
                            "to": d.effective.value,
                            "ground": d.ground,
                            "until_s": d.until_s,
                        },
                    )

            self.db.run_write(tx)
        return ChainMap(over, waiting)  # type: ignore[arg-type]

    def _without_unheard_nodes(self, s: Session, snap: ClusterSnapshot) -> ClusterSnapshot:
        """``snap`` with the nodes this leader has not heard from made unschedulable: no
        heartbeat recorded since ``Leadership.listening_since`` (database clock), whichever
        controller replica recorded it. A new leader's first passes would otherwise place
        work on a node that died during the failover (it is fenced later and the job runs
        twice). Nodes once heard under this leadership are not read again; those that fall
        silent later become SUSPECT through the failure detector."""
        since = self.leadership.listening_since
        if since is None:
            return snap
        if self._heard_since != since:
            self._heard, self._heard_since = set(), since
        todo = [n.node_id for n in snap.nodes if n.schedulable and n.node_id not in self._heard]
        if not todo:
            return snap
        heard = set(
            s.scalars(
                select(NodeRow.id).where(NodeRow.id.in_(todo), NodeRow.last_heartbeat_at >= since)
            )
        )
        self._heard |= heard
        unheard = set(todo) - heard
        if not unheard:
            return snap
        log.debug("not placing on %s: not heard from since this leader started", sorted(unheard))
        return replace(
            snap,
            nodes=tuple(
                replace(n, schedulable=False) if n.node_id in unheard else n for n in snap.nodes
            ),
            fleet_index=None,  # the index describes the nodes as loaded
        )

    def _place_batch(
        self, batch: list[Place], pending: Mapping[str, Any], stats: PassStats
    ) -> bool:
        """Reserve consecutive placements of one pass, those of different nodes concurrently
        (``RESERVE_THREADS`` connections; one node's in decision order on one thread, so
        they never wait on each other's rows), then dispatch each in decision order. Each
        reservation is its own transaction either way, and each was decided against the
        pass's snapshot as if all before it succeed, so the order between nodes does not
        matter: a conflict skips that one placement (the next pass sees the world), as it
        did one at a time. A reservation is one round trip (``allocate.place``), so one at a
        time the pass spent most of its time waiting (on the database and, with the
        controller's other threads busy, on the interpreter lock): at 300 hollow nodes ~25 ms
        per placement where the statement alone takes ~5 ms (benchmarks/fleet_scale.py).

        Returns False when leadership was lost (the pass stops, as for a single placement);
        a database error is raised after the placements that committed were dispatched."""
        by_node: dict[str, list[Place]] = {}
        for d in batch:
            by_node.setdefault(d.node_id, []).append(d)
        outcomes: dict[str, allocate.Reserved | Exception] = {}

        def reserve_all(decisions: list[Place]) -> None:
            for d in decisions:
                try:
                    outcomes[d.job_id] = self._reserve(d, pending[d.job_id].attempt)
                except Exception as exc:  # handed to the pass's thread below
                    outcomes[d.job_id] = exc
                    if isinstance(exc, NotLeader):
                        return

        groups = list(by_node.values())
        if len(groups) == 1 or self._reserve_pool is None:
            for g in groups:
                reserve_all(g)
        else:
            list(self._reserve_pool.map(reserve_all, groups))
        lost, failure = False, None
        for d in batch:
            out = outcomes.get(d.job_id)
            if isinstance(out, allocate.Reserved):
                stats.placed += 1
                stats.placed_runs.append(out.run_id)
                stats.applied.append(d)
                self._pool.submit(self.dispatch, out.run_id)
            elif isinstance(out, NotLeader):
                lost = True
            elif isinstance(out, (CapacityConflict, StaleState)):
                stats.conflicts += 1  # the world moved; the next pass sees it
                log.debug("skip %s: %s", d, out)
            elif isinstance(out, Exception) and failure is None:
                failure = out
        if lost:
            log.warning("lost leadership during a pass; stopping it")
            self.leadership.epoch = 0
            return False
        if failure is not None:
            raise failure
        return True

    def _reserve(self, decision: Place, seen_epoch: int) -> allocate.Reserved:
        # one statement on PostgreSQL, a write transaction on SQLite (allocate.place)
        return allocate.place(
            self.db,
            job_id=decision.job_id,
            node_id=decision.node_id,
            gpu_count=decision.gpu_count,
            # fencing_epoch and attempts move together (+1 per reservation)
            seen_fencing_epoch=seen_epoch,
            leader_holder=self.leadership.holder,
            leader_epoch=self.leadership.epoch,
            lease_s=self.settings.reservation_lease_s,
            holds=decision.job_id in self._holding,
            priority=self._run_priority(decision.job_id),
            gpu_milli=decision.gpu_milli,
        )

    def _run_priority(self, job_id: str) -> str | None:
        """The class a demoted job's attempt runs at (``job_runs.priority``), else None."""
        d = self._demoted_now.get(job_id)
        return d.effective.value if d is not None else None

    def _place_gang(self, decision: PlaceGang, seen_epoch: int, stats: PassStats) -> None:
        """Reserve every member of the gang or none (one transaction), then AssignJob to rank
        0 only: its agent picks MASTER_PORT, and its answer dispatches ranks 1..n-1."""
        reserved = self.db.run_write(
            partial(
                allocate.reserve_gang,
                job_id=decision.job_id,
                members=[(m.rank, m.node_id, m.gpu_count) for m in decision.members],
                seen_fencing_epoch=seen_epoch,
                leader_holder=self.leadership.holder,
                leader_epoch=self.leadership.epoch,
                lease_s=self.settings.reservation_lease_s,
                holds=decision.job_id in self._holding,
                priority=self._run_priority(decision.job_id),
            )
        )
        stats.placed += 1
        stats.placed_runs.extend(m.run_id for m in reserved.members)
        self._pool.submit(self.dispatch, reserved.members[0].run_id)

    def _preempt(self, decision: Preempt, stats: PassStats) -> None:
        self._holding.add(decision.for_job_id)
        orders = self.db.run_write(
            partial(
                preemption.apply_preempt,
                decision=decision,
                leader_holder=self.leadership.holder,
                leader_epoch=self.leadership.epoch,
            )
        )
        log.info(
            "preempting %s on %s for %s (%s)",
            [o.run_id for o in orders],
            decision.node_id,
            decision.for_job_id,
            decision.reason,
        )
        stats.preempted += len(orders)
        metrics.PREEMPTIONS.labels(decision.reason).inc(len(orders))
        for o in orders:
            if self.stops is not None:
                self.stops.send(o.address, o.run_id, o.token, "preempt", node_id=o.node_id)
            else:  # no stop driver wired (tests): the next stop-driver pass sends it
                self._pool.submit(
                    send_stop,
                    self.agents,
                    o.address,
                    o.run_id,
                    o.token,
                    self.leadership.epoch,
                    self.settings.default_grace_s,
                    "preempt",
                    node_id=o.node_id,
                )

    def _store_reasons(
        self,
        waiting: Mapping[str, WaitReason],
        stored: dict[str, object],
        now_s: float,
        fresh_estimates: bool = False,
    ) -> None:
        """Write pending_reason only where it materially changed: its code or details, or an
        estimated start that moved by more than ``ESTIMATE_SLACK_S``. Queue positions shift
        on every placement, so they are not a reason to rewrite 10k rows; the API computes
        the position when it is read. A new code is also appended to the audit events.

        Reasons are computed lazily by the policy and cost ~4 us each: jobs without a stored
        reason get theirs every pass, all jobs at most every ``REASONS_REFRESH_S``."""
        changed: dict[str, dict[str, object]] = {}
        new_codes: list[tuple[str, WaitReason]] = []
        estimates = self._estimates
        if fresh_estimates or now_s - self._reasons_refreshed_s >= REASONS_REFRESH_S:
            self._reasons_refreshed_s = now_s
            todo: Iterable[str] = waiting
        else:
            todo = [j for j in waiting if stored.get(j) is None]
        for job_id in todo:
            reason = waiting[job_id]
            old = stored.get(job_id)
            old = old if isinstance(old, dict) else {}
            estimate = estimates.get(job_id)
            if (
                old.get("code") == reason.code
                and old.get("details") == dict(reason.details)
                and not _estimate_moved(old.get("estimated_start_at"), reason, now_s)
                and not _estimate_changed(old.get("start_estimate"), estimate, now_s)
            ):
                continue
            new = reason_json(reason, now_s, estimate)
            changed[job_id] = new
            if old.get("code") != reason.code:
                new_codes.append((job_id, reason))
        if not changed:
            return

        def tx(s: Session) -> None:
            # one executemany of a statement built once, not one statement built per job
            s.execute(
                _store_reason(),
                [{"p_id": job_id, "p_reason": new} for job_id, new in changed.items()],
            )
            # on the background writer a later pass may have placed a job since: a
            # "waiting" event goes only to jobs still PENDING (the UPDATE above filters so)
            still = (
                set(
                    s.scalars(
                        select(JobRow.id).where(
                            JobRow.id.in_([j for j, _ in new_codes]),
                            JobRow.status == JobStatus.PENDING,
                        )
                    )
                )
                if new_codes and self._writer is not None
                else None
            )
            for job_id, reason in new_codes:
                if still is not None and job_id not in still:
                    continue
                record_event(
                    s,
                    "waiting",
                    job_id=job_id,
                    message=reason.message,
                    details={"code": reason.code, **dict(reason.details)},
                )

        if self._writer is None:
            self.db.run_write(tx)
            stored.update(changed)  # only once written
            return
        # off the pass's critical path: the next pass joins it (``_join_writes``) before it
        # compares its own reasons with ``stored``, so writes stay in pass order and
        # ``stored`` is updated only once written, by the pass thread
        self._writing = (self._writer.submit(self.db.run_write, tx), stored, changed)

    def _join_writes(self) -> None:
        """Wait for the previous pass's background reasons write; record what it wrote in
        its ``stored`` map once committed (a failure is logged: those reasons are compared
        and written again by this pass)."""
        writing, self._writing = self._writing, None
        if writing is None:
            return
        fut, stored, changed = writing
        try:
            fut.result()
        except Exception as exc:
            loop_failed("writing pending reasons", exc)
            return
        stored.update(changed)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._reserve_pool is not None:
            self._reserve_pool.shutdown(wait=False, cancel_futures=True)
