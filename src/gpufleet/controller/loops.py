"""Leader-only loops: the scheduler pass, the stop driver and the reconciler.

Each loop reads a short snapshot, decides outside any transaction, and applies each decision
in its own short transaction guarded by the leader epoch and the attempt's token. RPCs to
agents happen only after commit.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache, partial
from typing import Any, cast

import grpc
from sqlalchemy import Table, bindparam, exists, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, aliased

from gpufleet.controller import metrics
from gpufleet.controller.agents import AgentClients
from gpufleet.domain.errors import CapacityConflict, NotLeader, StaleState
from gpufleet.domain.states import JobStatus, NodeStatus, RunStatus
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import (
    Decision,
    HoldForBackfill,
    Place,
    PlaceGang,
    Preempt,
    WaitReason,
)
from gpufleet.policy.snapshot import BackfillReservation
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.services import nodes, preemption, runs
from gpufleet.services.jobs import iso
from gpufleet.settings import Settings
from gpufleet.store import allocate, gating
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.predictions import HistoryPredictor
from gpufleet.store.snapshot_cache import SnapshotCache
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
    applied: list[Decision] = field(default_factory=list)
    """Decisions committed in this pass (for the metrics)."""


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
def _assignment_query() -> Any:
    """ONE statement, built once (``p_run``): the attempt, its job, node and reservation, and
    the checkpoint to resume from: the latest earlier attempt's that stored one (of a gang:
    every rank resumes from rank 0's, else from the lowest rank that stored one)."""
    earlier = aliased(JobRunRow)
    prior_q = (
        select(earlier.checkpoint_prefix)
        .where(
            earlier.job_id == JobRunRow.job_id,
            earlier.checkpoint_prefix.is_not(None),
            earlier.attempt < JobRunRow.attempt,
        )
        .order_by(earlier.attempt.desc(), earlier.rank)
        .limit(1)
        .correlate(JobRunRow)
        .scalar_subquery()
    )
    return (
        select(JobRunRow, JobRow, NodeRow, ReservationRow.id, prior_q)
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .join(ReservationRow, ReservationRow.run_id == JobRunRow.id)
        .where(JobRunRow.id == bindparam("p_run", type_=JobRunRow.id.type))
    )


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
        self.predictions = HistoryPredictor()
        """Run-time predictions from finished attempts (ordering and reservations, never
        stops): warmed at this process's first pass as leader, refreshed every
        ``PREDICTION_REFRESH_S``."""
        self._predictions_read_s: float | None = None
        self._snapshots = SnapshotCache(
            self.policy, full_every_s=settings.scheduler_full_snapshot_every_s
        )
        """The leader's incremental snapshot (``store.snapshot_cache``)."""
        self._reasons_refreshed_s = 0.0
        self._stored: dict[str, object] | None = None
        self._stored_epoch = 0
        self._holding: set[str] = set()
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
                    displacement_window_s=max(3600.0, self.policy.anti_thrash_s),
                )
                # held jobs, unmet dependencies and arrays at their %N limit never reach
                # the policy
                gated = gating.gate_snapshot(s, snap, self._snapshots.queued)
                snap = gated.snapshot
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
            except SQLAlchemyError:  # placements go on; the next pass tries again
                log.exception("could not end jobs with unsatisfiable dependencies")
        result = schedule(snap, self.policy)
        pending = self._snapshots.pending_jobs(_job_ids(result.decisions))
        backfill: list[BackfillReservation] = []
        for decision in result.decisions:
            try:
                if isinstance(decision, Place):
                    job = pending[decision.job_id]
                    if (job.resources.nodes or 1) > 1:
                        # an explicit multi-node job only ever runs as a gang (PlaceGang)
                        log.warning("skip %s: job %s asks for a gang", decision, job.job_id)
                        continue
                    self._place(decision, job.attempt, stats)
                elif isinstance(decision, PlaceGang):
                    self._place_gang(decision, pending[decision.job_id].attempt, stats)
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
        stored = {j: self._stored.get(j) for j in waiting}
        self._stored = stored
        self._store_reasons(waiting, stored, snap.now_s)
        stats.seconds = time.perf_counter() - t0
        metrics.observe_pass(
            snap,
            result,
            stats.applied,
            seconds=stats.seconds,
            conflicts=stats.conflicts,
            config=self.policy,
            pending_by_id=pending,
        )
        return stats

    def _place(self, decision: Place, seen_epoch: int, stats: PassStats) -> None:
        # one statement on PostgreSQL, a write transaction on SQLite (allocate.place)
        reserved = allocate.place(
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
        )
        stats.placed += 1
        stats.placed_runs.append(reserved.run_id)
        self._pool.submit(self.dispatch, reserved.run_id)

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
            # one executemany of a statement built once, not one statement built per job
            s.execute(
                _store_reason(),
                [{"p_id": job_id, "p_reason": new} for job_id, new in changed.items()],
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
        if resp.result == pb.AssignJobResponse.NODE_UNHEALTHY:
            # nothing was logged or started, and the agent refuses later copies: re-place the
            # job elsewhere, charged to the node (no user retry), and stop placing there
            log.warning("agent %s refused %s: %s", node_id, run_id, resp.message)
            self.db.run_write(partial(nodes.mark_unhealthy, node_id=node_id, reason=resp.message))
            record_never_started(
                self.db,
                self.store,
                self.leadership,
                run_id=run_id,
                token=req.token,
                message=resp.message or "node unhealthy",
                node_fault=True,
                node_refused=True,
                max_node_failures=self.settings.max_node_failures,
            )
            return
        if resp.result == pb.AssignJobResponse.REJECTED_STALE:
            # the agent refused a run_id it had not logged (and tombstoned it): it never
            # started. Leader-fenced: a deposed leader's late answer writes nothing, and a
            # confirmed attempt is never overridden by this inference.
            log.warning("agent %s rejected %s as stale: %s", node_id, run_id, resp.message)
            record_never_started(
                self.db,
                self.store,
                self.leadership,
                run_id=run_id,
                token=req.token,
                message=f"agent refused it: {resp.message}",
            )
            return
        if req.gang_size > 1 or resp.result != pb.AssignJobResponse.STARTED:
            self.db.run_write(partial(runs.mark_delivered, run_id=run_id))
        # else: a fresh start, whose ConfirmAssignment (sent by the agent as it answers, and
        # retried until answered) records the delivery with the start in one transaction;
        # this write would only queue behind or ahead of it on the same row. Should the
        # confirmation never come, the reconciler re-sends after 2 s (not the confirm
        # timeout) and the agent's ALREADY_RUNNING answer is recorded here.
        if (
            req.gang_size > 1
            and req.rank == 0
            and resp.master_port
            and resp.result in (pb.AssignJobResponse.STARTED, pb.AssignJobResponse.ALREADY_RUNNING)
        ):
            # rank 0 runs (or ran) and its agent chose MASTER_PORT: now the other ranks
            others = self.db.run_write(
                partial(runs.record_master_port, run_id=run_id, port=resp.master_port)
            )
            for other in others:
                self._pool.submit(self.dispatch, other)

    def _assignment(self, run_id: str) -> tuple[str, str, pb.AssignJobRequest] | None:
        """(node_id, agent address, AssignJob request) of an ASSIGNED attempt, else None."""
        with self.db.read() as s:
            found = s.execute(_assignment_query(), {"p_run": run_id}).first()
            if found is None or found[0].status != RunStatus.ASSIGNED:
                return None
            run, job, node, reservation_id, prior = found
            env = dict(spec_env(job.spec))
            if run.gang_size > 1:
                rank0 = s.execute(
                    select(JobRunRow.master_port, NodeRow.address)
                    .join(NodeRow, NodeRow.id == JobRunRow.node_id)
                    .where(
                        JobRunRow.job_id == job.id,
                        JobRunRow.token == run.token,
                        JobRunRow.rank == 0,
                    )
                ).one()
                if run.rank > 0 and not rank0.master_port:
                    return None  # rank 0's agent has not chosen MASTER_PORT yet
                env.update(
                    gang_env(
                        rank=run.rank,
                        gang_size=run.gang_size,
                        gpus_here=len(run.gpu_ids),
                        gpu_count=job.gpu_count,
                        master_addr=host_of(rank0.address),
                        master_port=rank0.master_port,
                    )
                )
        spec = job.spec
        req = pb.AssignJobRequest(
            run_id=run.id,
            job_id=job.id,
            reservation_id=reservation_id,
            token=run.token,
            leader_epoch=self.leadership.epoch,
            gpu_ids=run.gpu_ids,
            command=spec["command"],
            env=env,
            image=spec.get("image") or "",
            resume_from_uri=self.store.uri(prior) if prior else "",
            max_runtime_s=float(spec.get("max_runtime_s") or 0),
            attempt=run.attempt,
            working_dir=spec.get("working_dir") or "",
            memory_mb=int((spec.get("resources") or {}).get("memory_mb") or 0),
            cpu=float((spec.get("resources") or {}).get("cpu") or 0),
            rank=run.rank,
            gang_size=run.gang_size,
        )
        return node.id, node.address, req

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def spec_env(spec: Mapping[str, object]) -> Mapping[str, str]:
    env = spec.get("env") or {}
    assert isinstance(env, dict)
    return env


def host_of(address: str) -> str:
    """The host part of an agent's ``host:port`` gRPC address (brackets of IPv6 removed)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"


def gang_env(
    *,
    rank: int,
    gang_size: int,
    gpus_here: int,
    gpu_count: int,
    master_addr: str,
    master_port: int | None,
) -> dict[str, str]:
    """The distributed-training environment of one gang member (docs/design/gangs.md).

    The platform starts ONE process per node (the job's command); so, for a plain script
    that calls ``torch.distributed.init_process_group("gloo"/"nccl")`` with ``env://``:
    ``WORLD_SIZE`` = members, ``RANK`` = ``NODE_RANK`` = this member's rank, ``LOCAL_RANK``
    = 0, ``LOCAL_WORLD_SIZE`` = 1, ``MASTER_ADDR``/``MASTER_PORT`` = rank 0's node and the
    port its agent chose. A command that is ``torchrun`` (one worker per GPU) finds its
    arguments in ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE`` (this node's
    GPUs), ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` and then sets ``WORLD_SIZE``/``RANK``/
    ``LOCAL_*`` of its workers itself. ``GPUFLEET_GANG_SIZE``/``GPUFLEET_NNODES``,
    ``GPUFLEET_NODE_RANK``, ``GPUFLEET_GPUS_PER_NODE`` and ``GPUFLEET_WORLD_GPUS`` (all the
    job's GPUs) name the same facts in the platform's own words. ``master_port`` None
    (rank 0 before its agent chose it): rank 0's agent adds ``MASTER_PORT`` itself."""
    env = {
        "WORLD_SIZE": str(gang_size),
        "RANK": str(rank),
        "NODE_RANK": str(rank),
        "GROUP_RANK": str(rank),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": master_addr,
        "GPUFLEET_GANG_SIZE": str(gang_size),
        "GPUFLEET_NNODES": str(gang_size),
        "GPUFLEET_NODE_RANK": str(rank),
        "GPUFLEET_GPUS_PER_NODE": str(gpus_here),
        "GPUFLEET_WORLD_GPUS": str(gpu_count),
        "PET_NNODES": str(gang_size),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": str(max(1, gpus_here)),
        "PET_MASTER_ADDR": master_addr,
    }
    if master_port:
        env["MASTER_PORT"] = env["PET_MASTER_PORT"] = str(master_port)
    return env


STOP_RETRY_BASE_S = 0.5
STOP_RETRY_CAP_S = 4.0
STOP_VERIFY_EXTRA_S = 10.0
"""StopRun re-send schedule. An unanswered StopRun (agent down, restarting, frozen) or a
refused one is re-sent after ``min(cap, base * 2**failures)`` seconds times a jitter in
[0.5, 1]; an acknowledged one (STOPPING) only after grace + ``STOP_VERIFY_EXTRA_S``, to
verify the completion report is coming."""


def stop_backoff_s(failures: int, rng: random.Random) -> float:
    """Seconds before the next StopRun after ``failures`` consecutive failed sends."""
    return min(STOP_RETRY_CAP_S, STOP_RETRY_BASE_S * 2.0 ** max(0, failures)) * rng.uniform(0.5, 1)


@dataclass
class _StopState:
    due_s: float = 0.0
    failures: int = 0
    inflight: bool = False


class StopDriver:
    """Turns cancel requests and max_runtime overruns into durable PREEMPTING + StopRun, and
    drives every PREEMPTING attempt until it ends:

    * a StopRun that was not answered is re-sent within seconds, with exponential backoff and
      jitter (:func:`stop_backoff_s`); one the agent acknowledged is re-sent after grace + 10 s;
    * NOT_FOUND from the agent is proof (its durable assignment log, plus a tombstone that
      refuses a late AssignJob) that the attempt never started: the attempt ends at once as
      NEVER_STARTED, leader-fenced, and its GPUs are released — unless it was confirmed
      running, which an inference never overrides;
    * a node that never answers is left to the failure detector (fencing, :class:`Reconciler`).

    Sends run in a small pool so a frozen agent never blocks the loop; the schedule is leader
    memory (a new leader sends every stop at once: StopRun is idempotent at the agent).
    """

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        settings: Settings,
        leadership: Leadership,
        agents: AgentClients,
    ) -> None:
        self.db, self.store, self.settings = db, store, settings
        self.leadership, self.agents = leadership, agents
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="stop")
        self._lock = threading.Lock()
        self._state: dict[str, _StopState] = {}
        self._rng = random.Random()

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
        with self._lock:  # forget attempts that ended
            live = {r.id for r in active}
            for run_id in [r for r in self._state if r not in live]:
                del self._state[run_id]
        sent = 0
        mono = time.monotonic()
        by_id = {r.id: r for r in active}
        done: set[str] = set()
        for run in active:
            if run.id in done:  # marked with its gang by an earlier member's stop
                continue
            cancel, max_runtime_s = run.cancel_requested, run.max_runtime_s
            reason = None
            if run.status == RunStatus.PREEMPTING:
                with self._lock:
                    st = self._state.get(run.id)
                    if st is not None and (st.inflight or mono < st.due_s):
                        continue
                reason = run.stop_reason or "cancel"
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
            marked = [run.id]
            if run.status != RunStatus.PREEMPTING:
                try:
                    marked = self.db.run_write(
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
                if not marked:
                    continue
                metrics.STOPS.labels(reason).inc()
            # a gang's members are all marked at once (runs.request_stop): stop each now
            for target in [by_id[r] for r in marked if r in by_id]:
                done.add(target.id)
                sent += 1
                self.send(target.address, target.id, target.token, reason, node_id=target.node_id)
        return sent

    def send(self, address: str, run_id: str, token: int, reason: str, *, node_id: str) -> None:
        """Send StopRun from the pool (at most one in flight per attempt) and act on the
        answer."""
        with self._lock:
            st = self._state.setdefault(run_id, _StopState())
            if st.inflight:
                return
            st.inflight = True
        self._pool.submit(self._send, address, run_id, token, reason, node_id)

    def _send(self, address: str, run_id: str, token: int, reason: str, node_id: str) -> None:
        delay: float | None = None
        try:
            resp = send_stop(
                self.agents,
                address,
                run_id,
                token,
                self.leadership.epoch,
                self.settings.default_grace_s,
                reason,
                node_id=node_id,
            )
            delay = self._after(run_id, token, resp)
        except Exception:
            log.exception("StopRun %s: handling the answer failed", run_id)
        finally:
            with self._lock:
                st = self._state.setdefault(run_id, _StopState())
                st.inflight = False
                if delay is None:  # unanswered or refused: soon, with backoff
                    delay = stop_backoff_s(st.failures, self._rng)
                    st.failures += 1
                else:
                    st.failures = 0
                st.due_s = time.monotonic() + delay

    def _after(self, run_id: str, token: int, resp: pb.StopRunResponse | None) -> float | None:
        """Act on a StopRun answer; returns the delay before the next send (None: backoff)."""
        if resp is None or resp.result == pb.StopRunResponse.REJECTED_STALE:
            return None
        if resp.result == pb.StopRunResponse.STOPPING:
            return float(self.settings.default_grace_s) + STOP_VERIFY_EXTRA_S
        if resp.result == pb.StopRunResponse.ALREADY_EXITED:
            return STOP_VERIFY_EXTRA_S  # the agent's completion report is on its way
        if resp.result == pb.StopRunResponse.NOT_FOUND:
            result, why = record_never_started(
                self.db,
                self.store,
                self.leadership,
                run_id=run_id,
                token=token,
                message=f"the agent never had it ({resp.message or 'StopRun: not found'})",
            )
            log.info("StopRun %s: NOT_FOUND -> %s %s", run_id, result, why)
            if result is not None:
                metrics.RECONCILE.labels("never_started").inc()
            return None if result is None else STOP_VERIFY_EXTRA_S
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def record_never_started(
    db: Database,
    store: ObjectStore,
    leadership: Leadership,
    *,
    run_id: str,
    token: int,
    message: str,
    node_fault: bool = False,
    node_refused: bool = False,
    max_node_failures: int = 3,
) -> tuple[runs.CompletionResult | None, str]:
    """End an attempt the agent says it never had (NEVER_STARTED), leader-fenced; never
    overrides a confirmed attempt. Returns (result, message); result None when this
    controller is no longer the leader (nothing written)."""
    with db.read() as s:
        node_id = s.execute(
            select(JobRunRow.node_id).where(JobRunRow.id == run_id)
        ).scalar_one_or_none()
    report = runs.Report(
        node_id=node_id or "",
        run_id=run_id,
        token=token,
        outcome=runs.Outcome.NEVER_STARTED,
        exit_code=0,
        manifest_uri="",
        message=message,
        node_fault=node_fault,
        node_refused=node_refused,
    )
    try:
        return runs.complete_run(
            db,
            store,
            report,
            leader=(leadership.holder, leadership.epoch),
            inferred=True,
            max_node_failures=max_node_failures,
        )
    except NotLeader as exc:
        return None, str(exc)


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
) -> pb.StopRunResponse | None:
    """StopRun to the agent of ``node_id`` (idempotent there). Returns its answer, or None
    when the agent did not answer (the stop driver re-sends)."""
    try:
        resp: pb.StopRunResponse = agents.stop(
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
    except grpc.RpcError as exc:
        log.warning("StopRun %s failed: %s (re-sent soon)", run_id, exc.code())
        return None
    log.info("StopRun %s (%s): %s", run_id, reason, pb.StopRunResponse.Result.Name(resp.result))
    return resp


@cache
def _stuck_assignments() -> Any:
    """The reconciler's query of undelivered or unconfirmed assignments on nodes that
    heartbeat, built once (bind parameters ``p_unsent``: created before this and never
    answered; ``p_cutoff``: answered before this and still not confirmed)."""
    rank0 = aliased(JobRunRow)
    return (
        select(JobRunRow.id, JobRunRow.node_id)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .where(
            JobRunRow.status == RunStatus.ASSIGNED,
            # nodes that heartbeat: their agent answers (or refuses) the question
            NodeRow.status.in_(
                [
                    NodeStatus.HEALTHY,
                    NodeStatus.UNHEALTHY,
                    NodeStatus.CORDONED,
                    NodeStatus.DRAINING,
                ]
            ),
            (
                JobRunRow.assigned_at.is_(None)
                & (JobRunRow.created_at < bindparam("p_unsent", type_=JobRunRow.created_at.type))
            )
            | (JobRunRow.assigned_at < bindparam("p_cutoff", type_=JobRunRow.created_at.type)),
            # ranks 1..n-1 of a gang wait for rank 0's MASTER_PORT (re-sending rank 0
            # assigns them)
            (JobRunRow.rank == 0)
            | exists().where(
                rank0.job_id == JobRunRow.job_id,
                rank0.token == JobRunRow.token,
                rank0.rank == 0,
                rank0.master_port.is_not(None),
            ),
        )
    )


class Reconciler:
    """The failure detector and the reconciler of undelivered work.

    * Silence for ``heartbeat_interval_s x suspect_after_missed`` -> SUSPECT: no placements,
      nothing released (silence is a question, not an answer).
    * Silence for ``fence_timeout_s`` -> the node's attempts are fenced in one leader-fenced
      transaction (:func:`services.nodes.fence_node`): FENCED, jobs re-placed elsewhere with a
      higher token, GPUs QUARANTINED until the agent reports the runs gone or an operator
      confirms the node dead. The scheduler is woken at once.
    * Undelivered or unconfirmed assignments on reachable nodes -> AssignJob again (idempotent
      per run_id, seed DD2); the agent's answer settles them (started, failed to start, or
      refused and tombstoned -> NEVER_STARTED).
    """

    def __init__(
        self,
        db: Database,
        settings: Settings,
        leadership: Leadership,
        dispatch: Callable[[str], None],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.db, self.settings, self.leadership, self.dispatch = db, settings, leadership, dispatch
        self.on_change = on_change

    def run_pass(self) -> None:
        if not self.leadership.is_leader:
            return
        silent_s = self.settings.heartbeat_interval_s * self.settings.suspect_after_missed
        fence_s = max(self.settings.fence_timeout_s, silent_s)
        # one read decides which write steps have work (usually none): each write
        # transaction is opened only then (on SQLite each takes the single writer lock)
        with self.db.read() as s:
            now = db_now(s)
            due = nodes.upkeep_due(
                s,
                suspect_before=now - timedelta(seconds=silent_s),
                fence_before=now - timedelta(seconds=fence_s),
            )
            stuck: list[tuple[str, str]] = [
                (r.id, r.node_id)
                for r in s.execute(
                    _stuck_assignments(),
                    {
                        "p_unsent": now - timedelta(seconds=2),
                        "p_cutoff": now - timedelta(seconds=self.settings.confirm_timeout_s),
                    },
                )
            ]
        suspects = (
            self.db.run_write(lambda s: nodes.mark_silent_nodes_suspect(s, silent_s))
            if due.suspect
            else []
        )
        metrics.NODE_TRANSITIONS.labels("SUSPECT").inc(len(suspects))
        for node_id in suspects:
            log.warning("node %s is SUSPECT: no heartbeat for %.0f s", node_id, silent_s)
        for node_id in self.db.run_write(nodes.finish_drains) if due.drains else []:
            metrics.NODE_TRANSITIONS.labels("CORDONED").inc()
            log.info("node %s drained: CORDONED", node_id)
        # a node just marked SUSPECT is silent for fence_s only later
        fenced: dict[str, list[nodes.Fenced]] = {}
        try:
            if due.fence:
                fenced = self.db.run_write(
                    partial(
                        nodes.fence_silent_nodes,
                        silent_for_s=fence_s,
                        max_node_failures=self.settings.max_node_failures,
                        leader_holder=self.leadership.holder,
                        leader_epoch=self.leadership.epoch,
                    )
                )
        except NotLeader:
            self.leadership.epoch = 0
            return
        for node_id, runs_fenced in fenced.items():
            metrics.NODE_TRANSITIONS.labels("FENCED").inc()
            metrics.RECONCILE.labels("fenced_run").inc(len(runs_fenced))
            log.warning(
                "node %s fenced after %.0f s of silence: %d attempt(s) fenced %s",
                node_id,
                self.settings.fence_timeout_s,
                len(runs_fenced),
                [
                    (f.run_id, str(getattr(f.job_status, "value", f.job_status)))
                    for f in runs_fenced
                ],
            )
        if fenced:
            self.on_change()
        for run_id, node_id in stuck:
            if node_id in fenced:  # read before this pass fenced its node: not re-sent
                continue
            metrics.RECONCILE.labels("resent_assignment").inc()
            self.db.run_write(
                partial(
                    record_event,
                    kind="reconcile",
                    run_id=run_id,
                    message="assignment not confirmed; re-sending",
                )
            )
            self.dispatch(run_id)
