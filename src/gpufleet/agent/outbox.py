"""Agent -> controller messages about attempts that must eventually be answered.

Two kinds of task, each retried with capped exponential backoff until the controller answers:

* **confirm**: ConfirmAssignment after a start. CONFIRMED is logged; REJECTED (stale token, or
  the attempt is no longer authoritative) is logged and the attempt is stopped with reason
  ``"stale"``.
* **complete**: for an attempt that ended, upload its outputs and manifest (once; the
  ``uploaded`` event records the manifest URI), then ReportCompletion until the answer is
  ACCEPTED, STALE or REJECTED, then log ``reported`` and delete the bulky local files. An
  attempt that never started is reported NEVER_STARTED with no manifest.

A completion waits for its attempt's confirmation, so the controller sees ASSIGNED -> RUNNING
before RUNNING -> terminal. Tasks live in memory only: after a restart they are rebuilt from
the assignment log (:meth:`gpufleet.agent.core.AgentCore.recover`), and both calls are
idempotent on the controller, so a repeat after a crash is harmless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gpufleet.agent.assignment_log import AssignmentLog, RunStatus
from gpufleet.agent.runner import Runner
from gpufleet.agent.uploader import LogStreamer, upload_attempt
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

logger = logging.getLogger("gpufleet.agent")

CONFIRM = "confirm"
COMPLETE = "complete"
CALL_TIMEOUT_S = 10.0
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0

_OUTCOMES = {
    "EXITED": pb.ReportCompletionRequest.EXITED,
    "STOPPED": pb.ReportCompletionRequest.STOPPED,
    "NEVER_STARTED": pb.ReportCompletionRequest.NEVER_STARTED,
}
_FINAL_REPORT_RESULTS = {
    pb.ReportCompletionResponse.ACCEPTED,
    pb.ReportCompletionResponse.STALE,
    pb.ReportCompletionResponse.REJECTED,
}


WORKERS_PER_KIND = 4


@dataclass(slots=True)
class _Task:
    kind: str
    run_id: str
    due_at: float = 0.0  # time.monotonic()
    failures: int = 0
    in_flight: bool = False  # a worker is running it (several workers share a kind)


class Outbox:
    """The confirm/complete task queue and its worker threads (``workers_per_kind`` each).

    Args:
        log: the assignment log (records are read from and events appended to it).
        runner: for attempt paths and local cleanup.
        streamer: the live-log mirror, told to forget an attempt before its final upload.
        store: the object store.
        stub: the controller's gRPC stub.
        node_id: this node.
        agent_epoch: this agent process's epoch.
        on_rejected: called with a run_id whose confirmation was REJECTED (stop it).
        ready: set once the node is registered; no task runs before.
        stop_event: ends the workers.
        workers_per_kind: worker threads per kind (default :data:`WORKERS_PER_KIND`; a
            hollow node, many to a process, has 1).
    """

    def __init__(
        self,
        *,
        log: AssignmentLog,
        runner: Runner,
        streamer: LogStreamer,
        store: ObjectStore,
        stub: pb_grpc.ControllerStub,
        node_id: str,
        agent_epoch: int,
        on_rejected: Callable[[str], None],
        ready: threading.Event,
        stop_event: threading.Event,
        workers_per_kind: int = WORKERS_PER_KIND,
    ) -> None:
        self.log = log
        self.runner = runner
        self.streamer = streamer
        self.store = store
        self.stub = stub
        self.node_id = node_id
        self.agent_epoch = agent_epoch
        self.on_rejected = on_rejected
        self.ready = ready
        self.stop_event = stop_event
        self._cond = threading.Condition()
        self._tasks: dict[tuple[str, str], _Task] = {}
        # Workers per kind, so a long upload never delays another attempt's confirmation, and
        # attempts that end together are uploaded and reported in parallel, not one by one.
        self.threads = [
            threading.Thread(
                target=self._loop, args=(kind,), name=f"agent-{kind}-{i}", daemon=True
            )
            for kind in (CONFIRM, COMPLETE)
            for i in range(max(1, workers_per_kind))
        ]

    def enqueue(self, kind: str, run_id: str) -> None:
        """Add a task (no-op if the same task is already queued) and wake the worker."""
        with self._cond:
            self._tasks.setdefault((kind, run_id), _Task(kind, run_id))
            self._cond.notify_all()

    def pending(self) -> list[tuple[str, str]]:
        """``(kind, run_id)`` of queued tasks (for tests and debugging)."""
        with self._cond:
            return list(self._tasks)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def retry_now(self) -> None:
        """Make every waiting task due at once (a controller answers again after an outage:
        completions that happened meanwhile are reported now, not after their backoff)."""
        with self._cond:
            for task in self._tasks.values():
                task.due_at = 0.0
            self._cond.notify_all()

    # ------------------------------------------------------------------ worker

    def _loop(self, kind: str) -> None:
        while not self.ready.wait(0.1):
            if self.stop_event.is_set():
                return
        while not self.stop_event.is_set():
            task = self._next_due(kind)
            if task is None:
                continue
            try:
                done = self._run(task)
            except (grpc.RpcError, OSError) as exc:
                done = False
                task.failures += 1
                # a controller outage fails every retry: say so at the first ones, then now
                # and then (the report is kept and sent when a controller answers)
                n = task.failures
                level = (
                    logging.INFO
                    if n < 5
                    else logging.WARNING
                    if n in (5, 10) or n % 50 == 0
                    else logging.DEBUG
                )
                logger.log(
                    level,
                    "run %s: %s failed %d time(s) (%s); retrying",
                    task.run_id,
                    task.kind,
                    n,
                    _short(exc),
                )
            except Exception:  # a bug or an unexpected store error: keep the worker alive
                done = False
                task.failures += 1
                logger.exception("run %s: %s failed; retrying", task.run_id, task.kind)
            with self._cond:
                task.in_flight = False
                if done:
                    self._tasks.pop((task.kind, task.run_id), None)
                    self._cond.notify_all()  # a completion may be waiting for this confirmation
                else:
                    delay = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(task.failures, 10))
                    task.due_at = time.monotonic() + delay

    def _next_due(self, kind: str) -> _Task | None:
        with self._cond:
            now = time.monotonic()
            mine = [
                t
                for t in self._tasks.values()
                if t.kind == kind
                and not t.in_flight
                # a completion waits for its attempt's confirmation without backing off: the
                # confirming worker's notify_all makes it due at once
                and not (kind == COMPLETE and (CONFIRM, t.run_id) in self._tasks)
            ]
            due = [t for t in mine if t.due_at <= now]
            if not due:
                next_at = min((t.due_at for t in mine), default=now + 1.0)
                self._cond.wait(timeout=max(0.01, min(1.0, next_at - now)))
                return None
            task = min(due, key=lambda t: t.due_at)
            task.in_flight = True
            return task

    def _run(self, task: _Task) -> bool:
        """Returns True when the task is finished (answered, or moot)."""
        rec = self.log.runs.get(task.run_id)
        if rec is None:
            return True
        if task.kind == CONFIRM:
            if rec.confirm_result or rec.status == RunStatus.REPORTED:
                return True
            resp = self.stub.ConfirmAssignment(
                pb.ConfirmAssignmentRequest(
                    node_id=self.node_id,
                    run_id=rec.run_id,
                    reservation_id=rec.reservation_id,
                    token=rec.token,
                    agent_epoch=self.agent_epoch,
                    pid=rec.pid,
                    start_phases=_phases(rec.start_phases),
                ),
                timeout=CALL_TIMEOUT_S,
            )
            if resp.result == pb.ConfirmAssignmentResponse.CONFIRMED:
                self.log.note("confirmed", rec.run_id, result="CONFIRMED")
                return True
            if resp.result == pb.ConfirmAssignmentResponse.REJECTED:
                logger.warning(
                    "run %s: confirmation rejected (%s): stopping it", rec.run_id, resp.message
                )
                self.log.note("confirmed", rec.run_id, result="REJECTED")
                self.on_rejected(rec.run_id)
                return True
            task.failures += 1
            return False
        # COMPLETE
        if rec.status == RunStatus.REPORTED:
            return True
        if rec.status not in (RunStatus.EXITED, RunStatus.FAILED_TO_START):
            return False  # not ended yet (should not happen: enqueued on exit)
        if (CONFIRM, rec.run_id) in self.pending() and not rec.confirm_result:
            return False
        if rec.status == RunStatus.EXITED and not rec.manifest_uri:
            self.streamer.forget(rec.run_id)
            uri = upload_attempt(self.store, rec, self.runner.paths(rec.run_id))
            self.log.note("uploaded", rec.run_id, manifest_uri=uri)
        resp = self.stub.ReportCompletion(
            pb.ReportCompletionRequest(
                node_id=self.node_id,
                run_id=rec.run_id,
                token=rec.token,
                manifest_uri=rec.manifest_uri,
                outcome=_OUTCOMES[rec.outcome],
                exit_code=rec.exit_code,
                message=rec.message,
                node_fault=rec.node_fault,
                reason=rec.reason,
                # both on this node's clock: the controller dates the end at its receipt
                # minus their difference (a late report still ends at the exit)
                ended_at_unix=rec.finished_at_s,
                sent_at_unix=time.time(),
                resources=_resources(rec.resources),
                stop_handshake=_handshake(rec.stop_handshake),
            ),
            timeout=CALL_TIMEOUT_S,
        )
        if resp.result not in _FINAL_REPORT_RESULTS:
            task.failures += 1
            return False
        result = pb.ReportCompletionResponse.Result.Name(resp.result)
        level = logging.INFO if result == "ACCEPTED" else logging.WARNING
        logger.log(
            level, "run %s: completion %s %s (%s)", rec.run_id, rec.outcome, result, resp.message
        )
        self.log.note("reported", rec.run_id, result=result)
        self.runner.cleanup(rec)
        return True


def _short(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def _phases(p: dict[str, object]) -> pb.StartPhases | None:
    """The ``start_phases`` of a ``started`` event as the ConfirmAssignment field."""
    if not p:
        return None
    return pb.StartPhases(
        runtime=str(p.get("runtime", "container")),
        image=str(p.get("image", "")),
        pull_s=float(p.get("pull_s", 0.0)),  # type: ignore[arg-type]
        create_s=float(p.get("create_s", 0.0)),  # type: ignore[arg-type]
        start_s=float(p.get("start_s", 0.0)),  # type: ignore[arg-type]
    )


def _resources(figures: dict[str, Any]) -> pb.AttemptResources | None:
    """The report's ``resources`` of an attempt's measured figures (None: none measured)."""
    known = {k: v for k, v in figures.items() if k in _RESOURCE_FIELDS and v is not None}
    if not known:
        return None
    out = pb.AttemptResources()
    for k, v in known.items():
        setattr(out, k, int(v) if k.endswith("_bytes") else float(v))
    return out


def _handshake(figures: dict[str, Any]) -> pb.StopHandshake | None:
    """The report's ``stop_handshake`` (None: no SIGTERM was sent)."""
    if not figures:
        return None
    return pb.StopHandshake(
        signalled=bool(figures.get("signalled")),
        grace_s=float(figures.get("grace_s") or 0.0),
        signal_after_s=float(figures.get("signal_after_s") or 0.0),
        saved_s=float(figures.get("saved_s") or 0.0),
    )


_RESOURCE_FIELDS = frozenset(
    {"peak_rss_bytes", "cpu_seconds", "gpu_util_pct", "gpu_mem_peak_bytes"}
)
