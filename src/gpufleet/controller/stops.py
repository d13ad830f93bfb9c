"""Stopping attempts (leader only): the stop driver and the StopRun it sends.

Holds :class:`StopDriver` (cancel requests and max_runtime overruns -> PREEMPTING + StopRun,
re-sent with backoff until the attempt ends), :func:`send_stop`, the re-send schedule
(:func:`stop_backoff_s`), and :func:`record_never_started`, which ends an attempt the agent
says it never had (a StopRun NOT_FOUND here, a refused AssignJob in
:mod:`gpufleet.controller.dispatch`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import grpc
from sqlalchemy import select

from gpufleet.controller import metrics
from gpufleet.controller.agents import AgentClients
from gpufleet.controller.leadership import Leadership
from gpufleet.controller.rpc_errors import loop_failed
from gpufleet.domain.errors import NotLeader, StaleState
from gpufleet.domain.states import RunStatus
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.services import runs
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow

log = logging.getLogger("gpufleet.controller")


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
        except Exception as exc:
            loop_failed(f"StopRun {run_id}: handling the answer", exc)
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
