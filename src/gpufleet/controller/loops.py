"""Leader-only loops: the scheduler pass, the stop driver and the reconciler.

Each loop reads a short snapshot, decides outside any transaction, and applies each decision
in its own short transaction guarded by the leader epoch and the attempt's token. RPCs to
agents happen only after commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial

import grpc
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpufleet.controller.agents import AgentClients
from gpufleet.domain.errors import CapacityConflict, NotLeader, StaleState
from gpufleet.domain.states import JobStatus, NodeStatus, RunStatus
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill, Place, Preempt, WaitReason
from gpufleet.policy.snapshot import BackfillReservation
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.services import nodes, preemption, runs
from gpufleet.services.jobs import iso
from gpufleet.settings import Settings
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import SpecCache, load_snapshot
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, ReservationRow
from gpufleet.store.transitions import record_event

log = logging.getLogger("gpufleet.controller")


@dataclass
class Leadership:
    """This controller's view of its lease (re-checked inside every write anyway)."""

    holder: str
    epoch: int = 0

    @property
    def is_leader(self) -> bool:
        return self.epoch > 0


@dataclass
class PassStats:
    pending: int = 0
    placed: int = 0
    preempted: int = 0
    conflicts: int = 0
    seconds: float = 0.0
    placed_runs: list[str] = field(default_factory=list)


def reason_json(reason: WaitReason, now_s: float) -> dict[str, object]:
    """The stored and served form of a wait reason (``pending_reason``)."""
    est = reason.estimated_start_s
    return {
        "code": reason.code,
        "message": reason.message,
        "details": dict(reason.details),
        "position": reason.position,
        "estimated_start_at": iso(datetime.fromtimestamp(est, UTC))
        if est is not None and est >= now_s
        else None,
    }


ESTIMATE_SLACK_S = 30.0
REASONS_REFRESH_S = 2.0


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


class Scheduler:
    """One pass: snapshot -> ``policy.schedule`` -> reserve each Place -> AssignJob (after
    commit)."""

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        settings: Settings,
        leadership: Leadership,
        agents: AgentClients,
        policy: PolicyConfig | None = None,
    ) -> None:
        self.db, self.store, self.settings = db, store, settings
        self.leadership, self.agents = leadership, agents
        self.policy = policy or PolicyConfig()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="assign")
        self._backfill: tuple[BackfillReservation, ...] = ()
        self._specs = SpecCache()
        self._reasons_refreshed_s = 0.0
        self._stored: dict[str, object] | None = None
        self._stored_epoch = 0
        """pending_reason per waiting job as this leader last wrote it (saves decoding 10k
        JSON values every pass)."""

    def run_pass(self) -> PassStats:
        t0 = time.perf_counter()
        stats = PassStats()
        if not self.leadership.is_leader:
            return stats
        with self.db.snapshot() as s:
            now = db_now(s)
            snap = load_snapshot(
                s,
                now,
                reservations=self._backfill,
                usage_half_life_s=self.policy.usage_half_life_s,
                spec_cache=self._specs,
            )
            if self._stored_epoch != self.leadership.epoch:
                self._stored, self._stored_epoch = None, self.leadership.epoch
            if self._stored is None:  # first pass of this leader: what earlier leaders wrote
                query = select(JobRow.id, JobRow.pending_reason).where(
                    JobRow.status == JobStatus.PENDING
                )
                # not dict(result): a Result has keys() and would be taken for a mapping
                self._stored = {row[0]: row[1] for row in s.execute(query)}
        stats.pending = len(snap.pending)
        result = schedule(snap, self.policy)
        pending = {p.job_id: p for p in snap.pending}
        backfill: list[BackfillReservation] = []
        for decision in result.decisions:
            try:
                if isinstance(decision, Place):
                    self._place(decision, pending[decision.job_id].attempt, stats)
                elif isinstance(decision, Preempt):
                    self._preempt(decision, stats)
                elif isinstance(decision, HoldForBackfill):
                    backfill.append(
                        BackfillReservation(
                            decision.job_id,
                            decision.node_id,
                            decision.gpu_count,
                            decision.start_at_s,
                        )
                    )
            except NotLeader:
                log.warning("lost leadership during a pass; stopping it")
                self.leadership.epoch = 0
                return stats
            except (CapacityConflict, StaleState) as exc:
                stats.conflicts += 1  # the world moved; the next pass sees it (assume/forget)
                log.debug("skip %s: %s", decision, exc)
        # kept in leader memory: a new leader recomputes them from scratch on its first pass
        self._backfill = tuple(backfill)
        if result.released_holds or snap.holds:
            self.db.run_write(partial(preemption.release_holds, job_ids=result.released_holds))
        # a job that left the queue (placed, cancelled) is forgotten: if it comes back (a retry)
        # its reason was reset in the database and is computed again as for a new job
        stored = {j: self._stored.get(j) for j in result.waiting}
        self._stored = stored
        self._store_reasons(result.waiting, stored, snap.now_s)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _place(self, decision: Place, seen_epoch: int, stats: PassStats) -> None:
        reserved = self.db.run_write(
            partial(
                allocate.reserve,
                job_id=decision.job_id,
                node_id=decision.node_id,
                gpu_count=decision.gpu_count,
                # fencing_epoch and attempts move together (+1 per reservation)
                seen_fencing_epoch=seen_epoch,
                leader_holder=self.leadership.holder,
                leader_epoch=self.leadership.epoch,
                lease_s=self.settings.reservation_lease_s,
            )
        )
        stats.placed += 1
        stats.placed_runs.append(reserved.run_id)
        self._pool.submit(self.dispatch, reserved.run_id)

    def _preempt(self, decision: Preempt, stats: PassStats) -> None:
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
        for o in orders:
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
        self, waiting: Mapping[str, WaitReason], stored: dict[str, object], now_s: float
    ) -> None:
        """Write pending_reason only where it materially changed: its code or details, or an
        estimated start that moved by more than ``ESTIMATE_SLACK_S``. Queue positions shift
        on every placement, so they are not a reason to rewrite 10k rows; the API computes
        the position when it is read. A new code is also appended to the audit events.

        Reasons are computed lazily by the policy and cost ~4 us each: jobs without a stored
        reason get theirs every pass, all jobs at most every ``REASONS_REFRESH_S``."""
        changed: dict[str, dict[str, object]] = {}
        new_codes: list[tuple[str, WaitReason]] = []
        if now_s - self._reasons_refreshed_s >= REASONS_REFRESH_S:
            self._reasons_refreshed_s = now_s
            todo: Iterable[str] = waiting
        else:
            todo = [j for j in waiting if stored.get(j) is None]
        for job_id in todo:
            reason = waiting[job_id]
            old = stored.get(job_id)
            old = old if isinstance(old, dict) else {}
            if (
                old.get("code") == reason.code
                and old.get("details") == dict(reason.details)
                and not _estimate_moved(old.get("estimated_start_at"), reason, now_s)
            ):
                continue
            new = reason_json(reason, now_s)
            changed[job_id] = new
            if old.get("code") != reason.code:
                new_codes.append((job_id, reason))
        if not changed:
            return

        def tx(s: Session) -> None:
            for job_id, new in changed.items():
                s.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.status == JobStatus.PENDING)
                    .values(pending_reason=new)
                )
            for job_id, reason in new_codes:
                record_event(
                    s,
                    "waiting",
                    job_id=job_id,
                    message=reason.message,
                    details={"code": reason.code, **dict(reason.details)},
                )

        self.db.run_write(tx)
        stored.update(changed)  # only once written

    def dispatch(self, run_id: str) -> None:
        """Send AssignJob for ``run_id`` (idempotent at the agent); record delivery. Runs in
        the assign pool, after the reservation committed; failures are left to the reconciler,
        which re-sends unconfirmed assignments."""
        try:
            found = self._assignment(run_id)
            if found is None:
                return
            node_id, address, req = found
            resp = self.agents.assign(node_id, address, req)
        except grpc.RpcError as exc:
            log.warning("AssignJob %s failed: %s (the reconciler retries)", run_id, exc.code())
            return
        except Exception:
            log.exception("dispatch of %s failed", run_id)
            return
        if resp.result == pb.AssignJobResponse.REJECTED_STALE:
            log.warning("agent rejected %s as stale: %s", run_id, resp.message)
            report = runs.Report(
                node_id=node_id,
                run_id=run_id,
                token=req.token,
                outcome=runs.Outcome.NEVER_STARTED,
                exit_code=0,
                manifest_uri="",
                message=f"agent refused it: {resp.message}",
            )
            runs.complete_run(self.db, self.store, report)
            return
        self.db.run_write(partial(runs.mark_delivered, run_id=run_id))

    def _assignment(self, run_id: str) -> tuple[str, str, pb.AssignJobRequest] | None:
        """(node_id, agent address, AssignJob request) of an ASSIGNED attempt, else None."""
        with self.db.read() as s:
            found = s.execute(
                select(JobRunRow, JobRow, NodeRow, ReservationRow.id)
                .join(JobRow, JobRow.id == JobRunRow.job_id)
                .join(NodeRow, NodeRow.id == JobRunRow.node_id)
                .join(ReservationRow, ReservationRow.run_id == JobRunRow.id)
                .where(JobRunRow.id == run_id)
            ).first()
            if found is None or found[0].status != RunStatus.ASSIGNED:
                return None
            run, job, node, reservation_id = found
            # resume from the latest earlier attempt that stored a checkpoint
            prior = s.execute(
                select(JobRunRow.checkpoint_prefix)
                .where(
                    JobRunRow.job_id == job.id,
                    JobRunRow.checkpoint_prefix.is_not(None),
                    JobRunRow.attempt < run.attempt,
                )
                .order_by(JobRunRow.attempt.desc())
                .limit(1)
            ).scalar_one_or_none()
        spec = job.spec
        req = pb.AssignJobRequest(
            run_id=run.id,
            job_id=job.id,
            reservation_id=reservation_id,
            token=run.token,
            leader_epoch=self.leadership.epoch,
            gpu_ids=run.gpu_ids,
            command=spec["command"],
            env=spec.get("env") or {},
            image=spec.get("image") or "",
            resume_from_uri=self.store.uri(prior) if prior else "",
            max_runtime_s=float(spec.get("max_runtime_s") or 0),
            attempt=run.attempt,
            working_dir=spec.get("working_dir") or "",
        )
        return node.id, node.address, req

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StopDriver:
    """Turns cancel requests and max_runtime overruns into durable PREEMPTING + StopRun, and
    re-sends StopRun for stops that have not been confirmed (idempotent at the agent)."""

    def __init__(
        self, db: Database, settings: Settings, leadership: Leadership, agents: AgentClients
    ) -> None:
        self.db, self.settings, self.leadership, self.agents = db, settings, leadership, agents

    def run_pass(self) -> int:
        if not self.leadership.is_leader:
            return 0
        with self.db.read() as s:
            now = db_now(s)
            # narrow rows: this scan runs every second over every active attempt
            active = s.execute(
                select(
                    JobRunRow.id,
                    JobRunRow.node_id,
                    JobRunRow.status,
                    JobRunRow.token,
                    JobRunRow.started_at,
                    JobRunRow.stop_requested_at,
                    JobRunRow.stop_reason,
                    JobRow.cancel_requested,
                    JobRow.max_runtime_s,
                    NodeRow.address,
                )
                .join(JobRow, JobRow.id == JobRunRow.job_id)
                .join(NodeRow, NodeRow.id == JobRunRow.node_id)
                .where(
                    JobRunRow.status.in_(
                        [RunStatus.ASSIGNED, RunStatus.RUNNING, RunStatus.PREEMPTING]
                    )
                )
            ).all()
        sent = 0
        for run in active:
            cancel, max_runtime_s, address = run.cancel_requested, run.max_runtime_s, run.address
            reason = None
            if run.status == RunStatus.PREEMPTING:
                resend_after = self.settings.default_grace_s + 10.0
                if (
                    run.stop_requested_at
                    and (now - run.stop_requested_at).total_seconds() > resend_after
                ):
                    reason = run.stop_reason
                    self.db.run_write(partial(runs.renew_stop_request, run_id=run.id))
                else:
                    continue
            elif cancel:
                reason = "cancel"
            elif (
                run.status == RunStatus.RUNNING
                and run.started_at
                and max_runtime_s
                and (now - run.started_at).total_seconds() > max_runtime_s
            ):
                reason = "timeout"
            if reason is None:
                continue
            if run.status != RunStatus.PREEMPTING:
                try:
                    ok = self.db.run_write(
                        partial(
                            runs.request_stop,
                            run_id=run.id,
                            token=run.token,
                            reason=reason,
                            message=f"stop requested ({reason})",
                        )
                    )
                except StaleState:
                    continue
                if not ok:
                    continue
            sent += 1
            send_stop(
                self.agents,
                address,
                run.id,
                run.token,
                self.leadership.epoch,
                self.settings.default_grace_s,
                reason,
                node_id=run.node_id,
            )
        return sent


def send_stop(
    agents: AgentClients,
    address: str,
    run_id: str,
    token: int,
    leader_epoch: int,
    grace_s: float,
    reason: str,
    *,
    node_id: str,
) -> None:
    """StopRun to the agent of ``node_id`` (idempotent there); failures are retried by the
    stop driver."""
    try:
        resp = agents.stop(
            node_id,
            address,
            pb.StopRunRequest(
                run_id=run_id,
                token=token,
                leader_epoch=leader_epoch,
                grace_s=grace_s,
                reason=reason,
            ),
        )
        log.info(
            "StopRun %s (%s): %s", run_id, reason, pb.StopRunResponse.Result.Name(resp.result)
        )
    except grpc.RpcError as exc:
        log.warning("StopRun %s failed: %s (re-sent later)", run_id, exc.code())


class Reconciler:
    """Silence -> SUSPECT (never a release); undelivered or unconfirmed assignments -> AssignJob
    again (idempotent per run_id, seed DD2)."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        leadership: Leadership,
        dispatch: Callable[[str], None],
    ) -> None:
        self.db, self.settings, self.leadership, self.dispatch = db, settings, leadership, dispatch

    def run_pass(self) -> None:
        if not self.leadership.is_leader:
            return
        silent_s = self.settings.heartbeat_interval_s * self.settings.suspect_after_missed
        suspects = self.db.run_write(lambda s: nodes.mark_silent_nodes_suspect(s, silent_s))
        for node_id in suspects:
            log.warning("node %s is SUSPECT: no heartbeat for %.0f s", node_id, silent_s)
        with self.db.read() as s:
            now = db_now(s)
            cutoff = now - timedelta(seconds=self.settings.confirm_timeout_s)
            stuck = list(
                s.scalars(
                    select(JobRunRow.id)
                    .join(NodeRow, NodeRow.id == JobRunRow.node_id)
                    .where(
                        JobRunRow.status == RunStatus.ASSIGNED,
                        NodeRow.status == NodeStatus.HEALTHY,
                        (
                            JobRunRow.assigned_at.is_(None)
                            & (JobRunRow.created_at < now - timedelta(seconds=2))
                        )
                        | (JobRunRow.assigned_at < cutoff),
                    )
                )
            )
        for run_id in stuck:
            self.db.run_write(
                partial(
                    record_event,
                    kind="reconcile",
                    run_id=run_id,
                    message="assignment not confirmed; re-sending",
                )
            )
            self.dispatch(run_id)
