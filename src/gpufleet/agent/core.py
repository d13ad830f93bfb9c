"""The agent's run table and the rules of AssignJob, StopRun and ListRuns (no gRPC here).

Rules, in the order they are checked:

* **At most one start per run_id.** The ``assigned`` event is fsynced before anything starts; a
  second AssignJob for a logged run_id answers from the log (ALREADY_RUNNING, ALREADY_EXITED,
  FAILED_TO_START) and never starts it again — also after an agent restart. This answer is
  given *whatever the request's leader epoch*: a deposed leader's late duplicate learns the
  truth (the run is running) instead of a refusal it would read as "never started".
* **Fencing of new work.** An AssignJob for a run_id not in the log whose leader epoch is lower
  than the highest this node has heard is REJECTED_STALE and tombstoned (a later copy is
  refused too), and so is one whose token is lower than the highest seen for its job. A
  StopRun with a lower leader epoch is REJECTED_STALE (all survive restarts: they are in the
  log).
* **No new start while out of touch.** An AssignJob that would start a new run_id, on an
  agent that has heard no controller for longer than the contact timeout the controller
  named (or not at all since it started), first renews contact (a heartbeat, at most ~3 s)
  and so learns the current leader epoch; if no controller answers it is refused
  (:class:`~gpufleet.agent.contact.OutOfTouch`, UNAVAILABLE: nothing logged or started).
  A frozen or partitioned node thus never starts the fenced attempt a deposed leader's
  late AssignJob carries (:mod:`gpufleet.agent.contact`).
* **Epochs from the future are not believed.** A controller's RegisterNode/Heartbeat answer
  carries the epoch of the current lease, read from the database by any replica (leader or
  standby); the agent adopts it. A request (AssignJob/StopRun) may raise the known epoch by at
  most ``LEADER_EPOCH_STEP`` (a new leader's first calls may overtake its first heartbeat
  answer); one beyond that is refused and not persisted, so a corrupt or forged epoch cannot
  make the agent refuse the real leader.
* **GPU pinning is checked.** A reservation naming a GPU this node does not have, or one held
  by another live attempt here, fails to start (reported NEVER_STARTED). The controller's
  database is the only allocator; this is defense in depth against double allocation.
* **Release after verified stop.** An attempt is reported only once its process group is
  verified gone (the runtime's ``poll``, :mod:`gpufleet.agent.runtime.base`).
* A StopRun for a run_id never assigned here leaves a tombstone, so an AssignJob that arrives
  late (reordered behind the stop) is refused instead of starting work nobody owns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from gpufleet.agent.assignment_log import AssignmentLog, RunRecord, RunStatus, is_disk_full
from gpufleet.agent.contact import Contact
from gpufleet.agent.gpu_health import GpuHealth
from gpufleet.agent.gpu_usage import GpuSampler
from gpufleet.agent.inventory import Inventory
from gpufleet.agent.outbox import COMPLETE, CONFIRM, Outbox
from gpufleet.agent.runner import Runner
from gpufleet.agent.runtime import RunHandle
from gpufleet.agent.runtime.base import NO_CONTAINER_RUNTIME
from gpufleet.agent.uploader import LogStreamer
from gpufleet.agent.workdir import StartError, newest_checkpoint_mtime
from gpufleet.netports import free_port
from gpufleet.rpc.protos import fleet_pb2 as pb

logger = logging.getLogger("gpufleet.agent")

AssignResult = pb.AssignJobResponse
StopResult = pb.StopRunResponse
_LIVE = (RunStatus.ASSIGNED, RunStatus.RUNNING)
_UNREPORTED = (*_LIVE, RunStatus.EXITED, RunStatus.FAILED_TO_START)
START_FAILURE_WINDOW_S = 600.0
LEADER_EPOCH_STEP = 2
"""How far above the highest known leader epoch a request's epoch may be and still be
believed (see the module doc)."""


class EpochFromTheFuture(ValueError):
    """A request's leader epoch is more than ``LEADER_EPOCH_STEP`` above the known one."""


class AgentCore:
    """The node's attempts: start, stop, watch, list.

    Args:
        log: the replayed assignment log.
        runner: process operations.
        streamer: live log mirror.
        inventory: the node's GPUs (for pinning checks and free-GPU counts).
        default_grace_s: grace used when a StopRun carries none (0 = unset in proto3).
        disk_reserve_mb: below this much free space (MiB) in the state or scratch directory
            the node refuses new work (NODE_UNHEALTHY "node unhealthy: disk: ...") and reports
            itself unhealthy, before the disk is full; 0 disables the check.
        gpu_health: NVML checks of the node's GPUs (lost GPU, uncorrectable ECC, pending page
            retirement, critical XID); None: no checks (declared GPUs).
        gpu_usage: NVML samples of each attempt's GPUs (utilization, memory), reported with
            its completion; None: none (declared GPUs, no NVML).
    """

    def __init__(
        self,
        *,
        log: AssignmentLog,
        runner: Runner,
        streamer: LogStreamer,
        inventory: Inventory,
        default_grace_s: float,
        disk_reserve_mb: int = 0,
        gpu_health: GpuHealth | None = None,
        gpu_usage: GpuSampler | None = None,
    ) -> None:
        self.log = log
        self.gpu_health = gpu_health
        self.gpu_usage = gpu_usage
        self.runner = runner
        self.streamer = streamer
        self.inventory = inventory
        self.default_grace_s = default_grace_s
        self.outbox: Outbox | None = None  # set by the wiring in main.py
        # when the control plane was last heard (main.py wires it; None: no check, tests)
        self.contact: Contact | None = None
        # called after each container start (it may have pulled): refresh the image list
        self.on_started: Callable[[], None] | None = None
        # Keys of log.runs are only added under this lock ("assigned", "tombstone"), so code
        # holding it may iterate log.runs while other threads append lifecycle events.
        self._lock = threading.RLock()
        self._handles: dict[str, RunHandle] = {}
        self._starting: dict[str, threading.Lock] = {}
        self.disk_reserve_mb = disk_reserve_mb
        self._refused: set[str] = set()  # run_ids refused while unhealthy (not logged)
        self._node_start_failures: deque[float] = deque()
        # the start found the disk full and could not compact the assignment log: retried at
        # each health check, the node unhealthy until it succeeds (see start_on_full_disk)
        self.compaction_deferred: str | None = None

    def compact_log(self) -> str | None:
        """Compact the assignment log (at start). On a full disk the agent still starts:
        the problem is logged once (``disk full at start: ... needs N MiB``), kept as the
        node's health reason and the compaction retried at each health check until space
        returns. Returns the problem, or None when the log was compacted.

        Raises:
            OSError: the compaction failed for another reason than a full disk.
        """
        self.runner.relieve(max(self.disk_reserve_mb, 1))  # old kept logs go first
        try:
            self.log.compact()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            # the snapshot's size, and the reserve a healthy node keeps free
            need_mb = max(-(-self.log.compact_size() // (1024 * 1024)), self.disk_reserve_mb)
            free = min(self.runner.disk_free_mb().values(), default=0)
            self.compaction_deferred = (
                f"disk full at start: cannot compact the assignment log {self.log.path} "
                f"({exc.strerror}): needs {need_mb} MiB free, has {free} MiB"
            )
            logger.error(
                "%s; the node reports itself unhealthy and retries when space returns",
                self.compaction_deferred,
            )
            return self.compaction_deferred
        self.compaction_deferred = None
        return None

    def _enqueue(self, kind: str, run_id: str) -> None:
        if self.outbox is not None:
            self.outbox.enqueue(kind, run_id)

    # ------------------------------------------------------------------ restart

    def recover(self) -> None:
        """Rebuild the live table from the replayed log: adopt what still runs, settle starts
        cut short by a crash, and queue the confirmations and reports that were not answered.
        Never starts anything."""
        for rec in list(self.log.runs.values()):
            if rec.status == RunStatus.ASSIGNED:
                h = self.runner.resolve_unstarted(rec)
                if h is None:
                    logger.warning("run %s: agent restarted mid-start; never started", rec.run_id)
                    self.log.note(
                        "start_failed",
                        rec.run_id,
                        message="the agent restarted before the start completed",
                    )
                else:
                    logger.info("run %s: adopting a shim started before a crash", rec.run_id)
                    self._log_started(rec, h)
            if rec.status == RunStatus.RUNNING:
                with self._lock:
                    if rec.run_id not in self._handles:
                        try:
                            self._handles[rec.run_id] = self.runner.adopt(rec)
                        except StartError as exc:
                            logger.error("run %s: cannot adopt it: %s", rec.run_id, exc)
                            continue
                self.streamer.watch(rec, self.runner.paths(rec.run_id).log)
                logger.info(
                    "run %s: adopted pid %d (%s runtime)", rec.run_id, rec.pid, rec.runtime
                )
            if rec.status in (RunStatus.RUNNING, RunStatus.EXITED) and not rec.confirm_result:
                self._enqueue(CONFIRM, rec.run_id)
            if rec.status in (RunStatus.EXITED, RunStatus.FAILED_TO_START):
                self._enqueue(COMPLETE, rec.run_id)

    # ------------------------------------------------------------------ AssignJob

    def assign(self, req: pb.AssignJobRequest) -> pb.AssignJobResponse:
        """Handle AssignJob: log durably, start once, answer (see module doc).

        Rank 0 of a gang (``gang_size > 1``, ``rank == 0``) gets ``MASTER_PORT`` chosen here,
        a free TCP port of this node, logged with the assignment (so a re-sent AssignJob
        answers the same port) and answered in ``master_port``; the controller then
        assigns ranks 1..n-1 with it.

        Raises:
            OSError: the assignment could not be logged (nothing was started).
            EpochFromTheFuture: a new run_id with an unbelievable leader epoch (not logged).
            OutOfTouch: a new run_id while no controller could be heard (not logged).
        """
        contact = self.contact
        if contact is not None and req.run_id not in self.log.runs:
            # before the table lock: the heartbeat that renews contact lists the runs
            try:
                contact.ensure()
            except Exception as exc:
                logger.warning("run %s refused for now: %s", req.run_id, exc)
                raise
        resp = self._assign_once(req)
        rec = self.log.runs.get(req.run_id)
        port = rec.env.get("MASTER_PORT", "") if rec is not None and req.gang_size > 1 else ""
        if port.isdigit() and req.rank == 0:
            resp.master_port = int(port)
        return resp

    def _assign_once(self, req: pb.AssignJobRequest) -> pb.AssignJobResponse:
        with self._lock:
            rec = self.log.runs.get(req.run_id)
            problem: str | None = None
            start_lock: threading.Lock | None = self._starting.get(req.run_id)
            if rec is None and req.run_id in self._refused:
                return _assign(AssignResult.NODE_UNHEALTHY, "refused earlier: node unhealthy")
            if rec is None:
                if req.leader_epoch < self.log.leader_epoch:
                    # tombstoned: a later copy of this request is refused too, so a
                    # controller that concludes "never started" from this answer is right
                    self.log.note("tombstone", req.run_id, reason="stale leader epoch")
                    return _assign(
                        AssignResult.REJECTED_STALE,
                        f"stale leader epoch {req.leader_epoch} < {self.log.leader_epoch}",
                    )
                self._check_future_epoch(req.leader_epoch)
                highest = self.log.job_tokens.get(req.job_id)
                if highest is not None and req.token < highest:
                    return _assign(
                        AssignResult.REJECTED_STALE,
                        f"stale token {req.token} < {highest} for job {req.job_id}",
                    )
                disk = self.disk_problem()
                if disk is not None:
                    self._refused.add(req.run_id)
                    logger.warning("run %s refused: %s", req.run_id, disk)
                    return _assign(AssignResult.NODE_UNHEALTHY, disk)
                if req.gang_size > 1 and req.rank == 0 and "MASTER_PORT" not in req.env:
                    port = str(free_tcp_port())
                    req.env["MASTER_PORT"] = port
                    req.env["PET_MASTER_PORT"] = port
                problem = self._gpu_problem(req.gpu_ids, req.gpu_milli)
                if problem is None and req.image and self.runner.runtimes.container is None:
                    problem = NO_CONTAINER_RUNTIME  # known before anything is prepared
                try:
                    self._log_assigned(req)
                except OSError as exc:  # nothing was logged, so nothing starts: refuse it
                    self._refused.add(req.run_id)
                    why = f"node unhealthy: disk: cannot log the assignment: {exc}"
                    logger.error("run %s refused: %s", req.run_id, why)
                    return _assign(AssignResult.NODE_UNHEALTHY, why)
                rec = self.log.runs[req.run_id]
                start_lock = threading.Lock()
                start_lock.acquire()
                self._starting[req.run_id] = start_lock
                fresh = True
            else:
                fresh = False
        if fresh and rec.image and problem is None:
            # An image start may pull for minutes: answer now, start in the background (the
            # attempt is reported STARTING meanwhile). A failure is reported NEVER_STARTED
            # through the completion path, like any failed start.
            threading.Thread(
                target=self._start,
                args=(rec, start_lock, problem),
                name=f"agent-start-{rec.run_id}",
                daemon=True,
            ).start()
            return _assign(AssignResult.STARTED, "starting (image pull and container start)")
        if fresh:  # outside the table lock: a start may download a checkpoint
            return self._start(rec, start_lock, problem)
        if start_lock is not None and rec.image and rec.token <= req.token:
            return _assign(AssignResult.ALREADY_RUNNING, "start in progress")
        if start_lock is not None:  # a concurrent duplicate: wait for the first to finish
            with start_lock:
                pass
        return self._answer_existing(rec, req.token)

    def _log_assigned(self, req: pb.AssignJobRequest) -> None:
        self.log.append(
            "assigned",
            req.run_id,
            job_id=req.job_id,
            reservation_id=req.reservation_id,
            token=req.token,
            leader_epoch=req.leader_epoch,
            attempt=req.attempt,
            gpu_ids=list(req.gpu_ids),
            command=list(req.command),
            env=dict(req.env),
            image=req.image,
            resume_from_uri=req.resume_from_uri,
            max_runtime_s=req.max_runtime_s,
            working_dir=req.working_dir,
            memory_mb=req.memory_mb,
            cpu=req.cpu,
            pids_limit=req.pids_limit,
            disk_mb=req.disk_mb,
            mounts=[
                {"source": src, "target": dst, "read_only": ro}
                for src, dst, ro in zip(
                    req.mount_sources,
                    req.mount_targets,
                    list(req.mount_read_only)
                    + [False] * (len(req.mount_sources) - len(req.mount_read_only)),
                    strict=False,
                )
            ],
            shm_size_mb=req.shm_size_mb,
            gpu_milli=req.gpu_milli,
            gpu_sharing=self.inventory.gpu_sharing,
        )

    def _start(
        self, rec: RunRecord, start_lock: threading.Lock | None, problem: str | None
    ) -> pb.AssignJobResponse:
        try:
            if problem is not None:
                raise StartError(problem, node_fault=True)
            h = self.runner.spawn(rec)
        except Exception as exc:
            if not isinstance(exc, StartError):
                logger.exception("run %s: unexpected error while starting", rec.run_id)
            # the node's fault: its disk (ENOSPC...), the shim or runtime, an agent error;
            # the job's: its command or working_dir (reported by the shim), its resume URI
            node_fault = not isinstance(exc, StartError) or exc.node_fault
            logger.warning(
                "run %s: failed to start (%s fault): %s",
                rec.run_id,
                "node" if node_fault else "job",
                exc,
            )
            if node_fault:
                with self._lock:
                    self._node_start_failures.append(time.monotonic())
            self.log.note("start_failed", rec.run_id, message=str(exc), node_fault=node_fault)
            self._enqueue(COMPLETE, rec.run_id)
            return _assign(AssignResult.FAILED_TO_START, str(exc))
        finally:
            with self._lock:
                self._starting.pop(rec.run_id, None)
            if start_lock is not None:
                start_lock.release()
        self._log_started(rec, h)
        self._enqueue(CONFIRM, rec.run_id)
        if rec.image and self.on_started is not None:  # a process start changes no image
            self.on_started()
        logger.info("run %s: started pid %d on GPUs %s", rec.run_id, h.pid, rec.gpu_ids)
        return _assign(AssignResult.STARTED, "", h.pid)

    def _log_started(self, rec: RunRecord, h: RunHandle) -> None:
        with self._lock:
            self.log.append(
                "started",
                rec.run_id,
                **self.runner.started_fields(rec, h),
                started_at_s=time.time(),
            )
            self._handles[rec.run_id] = h
        self.streamer.watch(rec, self.runner.paths(rec.run_id).log)

    def _answer_existing(self, rec: RunRecord, token: int) -> pb.AssignJobResponse:
        if token < rec.token:
            return _assign(AssignResult.REJECTED_STALE, f"stale token {token} < {rec.token}")
        if rec.status == RunStatus.TOMBSTONED:
            return _assign(AssignResult.REJECTED_STALE, "a stop for this run arrived first")
        if rec.status == RunStatus.FAILED_TO_START or rec.outcome == "NEVER_STARTED":
            return _assign(AssignResult.FAILED_TO_START, rec.message)
        if rec.status in _LIVE:
            return _assign(AssignResult.ALREADY_RUNNING, "", rec.pid)
        return _assign(AssignResult.ALREADY_EXITED, f"exit code {rec.exit_code}", rec.pid)

    def _gpu_problem(self, gpu_ids: Iterable[int], gpu_milli: int = 0) -> str | None:
        """Why this node cannot run an attempt on ``gpu_ids`` now (None: it can): a GPU it
        lacks, or one a live attempt holds whole; a share (``gpu_milli``) may join live
        shares of its GPU while they sum to at most one GPU, and never a GPU held whole, nor
        on a node that does not share GPUs (the agent's own check of the database's rule)."""
        have = {g.index for g in self.inventory.gpus}
        held: dict[int, str] = {}
        shares: dict[int, int] = {}
        for r in self.log.runs.values():
            if r.status not in _LIVE:
                continue
            for gpu in r.gpu_ids:
                if r.gpu_milli:
                    shares[gpu] = shares.get(gpu, 0) + r.gpu_milli
                    held.setdefault(gpu, r.run_id)
                else:
                    held[gpu] = r.run_id
                    shares.pop(gpu, None)
        if gpu_milli and self.inventory.gpu_sharing == "none":
            return "this node does not share GPUs (agent --gpu-sharing none)"
        for gpu in gpu_ids:
            if gpu not in have:
                return f"GPU {gpu} is not on this node (it has {sorted(have)})"
            if gpu not in held:
                continue
            if not gpu_milli or gpu not in shares:
                return f"GPU {gpu} is held by live run {held[gpu]}"
            if shares[gpu] + gpu_milli > 1000:
                return (
                    f"GPU {gpu}: live shares hold {shares[gpu]}/1000 of it, no room for"
                    f" {gpu_milli}/1000"
                )
        return None

    # ------------------------------------------------------------------ StopRun

    def stop(
        self, run_id: str, *, token: int, leader_epoch: int, grace_s: float, reason: str
    ) -> pb.StopRunResponse:
        """Request a stop: SIGTERM, grace, SIGKILL, verify; the report follows (STOPPED).

        ``grace_s <= 0`` (unset) means the default grace. A second stop may shorten the grace.

        Raises:
            OSError: the request could not be logged.
        """
        with self._lock:
            if leader_epoch < self.log.leader_epoch:
                return _stop(StopResult.REJECTED_STALE, "stale leader epoch")
            try:
                self._check_future_epoch(leader_epoch)
            except EpochFromTheFuture as exc:
                return _stop(StopResult.REJECTED_STALE, str(exc))
            rec = self.log.runs.get(run_id)
            if rec is None:
                # the epoch of a stop for a run this node never had is not adopted: only the
                # run_id is tombstoned (a stray or misaddressed call cannot fence this node)
                self.log.note("tombstone", run_id, reason=reason)
                return _stop(StopResult.NOT_FOUND, "never assigned here")
            if leader_epoch > self.log.leader_epoch:
                self.log.note("leader_epoch", epoch=leader_epoch)
            if token < rec.token:
                return _stop(StopResult.REJECTED_STALE, f"stale token {token} < {rec.token}")
            if rec.status in (RunStatus.TOMBSTONED, RunStatus.FAILED_TO_START):
                return _stop(StopResult.NOT_FOUND, "never started")
            if rec.status not in _LIVE:
                return _stop(StopResult.ALREADY_EXITED, f"exit code {rec.exit_code}")
            grace = grace_s if grace_s > 0 else self.default_grace_s
            if not rec.stop_requested or grace < rec.stop_grace_s:
                logger.info("run %s: stop requested (%s, grace %g s)", run_id, reason, grace)
                self.log.note(
                    "stop_requested", run_id, reason=rec.stop_reason or reason, grace_s=grace
                )
            return _stop(StopResult.STOPPING, "")

    def stop_stale(self, run_id: str) -> None:
        """Stop an attempt whose confirmation the controller rejected."""
        rec = self.log.runs.get(run_id)
        if rec is not None:
            self.stop(
                run_id,
                token=rec.token,
                leader_epoch=self.log.leader_epoch,
                grace_s=0.0,
                reason="stale",
            )

    def _check_future_epoch(self, epoch: int) -> None:
        if epoch > self.log.leader_epoch + LEADER_EPOCH_STEP:
            raise EpochFromTheFuture(
                f"leader epoch {epoch} is more than {LEADER_EPOCH_STEP} above the known"
                f" {self.log.leader_epoch}; not believed until a controller's heartbeat"
                " answer confirms it"
            )

    def note_leader_epoch(self, epoch: int) -> None:
        """Remember a higher leader epoch heard in a controller's RegisterNode/Heartbeat
        answer (the current lease's epoch, from the database)."""
        with self._lock:
            if epoch > self.log.leader_epoch:
                # on a full disk in memory only: the next answer after a restart tells again
                self.log.note("leader_epoch", epoch=epoch)

    # ------------------------------------------------------------------ monitor

    def monitor_once(self) -> None:
        """Poll every live attempt once; record and queue the report of those that ended."""
        now = time.monotonic()
        with self._lock:
            items = [(self.log.runs[rid], h) for rid, h in self._handles.items()]
        if self.gpu_usage is not None and self.gpu_usage.enabled:
            self.gpu_usage.sample((rec.run_id, rec.gpu_ids) for rec, _ in items)
        for rec, h in items:
            try:
                info = self.runner.poll(rec, h, now)
            except OSError:  # e.g. /proc raced a vanishing process: next tick retries
                logger.exception("run %s: poll failed", rec.run_id)
                continue
            if info is None:
                continue
            with self._lock:
                # note(): on a full disk the real exit code is kept in memory and reported
                if info.never_started:
                    self.log.note("start_failed", rec.run_id, message=info.message)
                else:
                    outcome = "STOPPED" if rec.stop_requested else "EXITED"
                    gpu = self.gpu_usage.take(rec.run_id) if self.gpu_usage is not None else {}
                    self.log.note(
                        "exited",
                        rec.run_id,
                        exit_code=info.exit_code,
                        outcome=outcome,
                        finished_at_s=info.finished_at_s,
                        message=info.message,
                        reason=info.reason,
                        resources={**info.resources, **gpu},
                        stop_handshake=dict(info.stop_handshake),
                    )
                del self._handles[rec.run_id]
            logger.info(
                "run %s: %s, exit code %d%s",
                rec.run_id,
                rec.outcome,
                rec.exit_code,
                f" ({info.message})" if info.message else "",
            )
            self._enqueue(COMPLETE, rec.run_id)

    # ------------------------------------------------------------------ views

    def run_refs(self, *, checkpoints: bool = False) -> list[pb.RunRef]:
        """Attempts not yet acknowledged by the controller.

        State ``STARTING`` (an image attempt being pulled/created in the background: the
        controller must not take it for started), ``RUNNING`` (alive, or a process start in
        progress), ``STOPPING`` (a stop is in progress) or ``EXITED`` (ended or failed to
        start; the report is on its way). Reported and tombstoned runs are omitted.

        ``checkpoints`` (heartbeats): a RUNNING or STOPPING attempt carries
        ``last_checkpoint_unix``, the newest file time in its checkpoint directory
        (``workdir.newest_checkpoint_mtime``; 0 when it holds none or cannot be read), read
        after the run table's lock is released.
        """
        with self._lock:
            refs = []
            for rec in self.log.runs.values():
                if rec.status not in _UNREPORTED:
                    continue
                if rec.status == RunStatus.ASSIGNED and rec.image:
                    state = "STARTING"  # pulling/creating: not to be confirmed from here
                elif rec.status in _LIVE:
                    state = "STOPPING" if rec.stop_requested else "RUNNING"
                else:
                    state = "EXITED"
                refs.append(
                    pb.RunRef(
                        run_id=rec.run_id,
                        job_id=rec.job_id,
                        token=rec.token,
                        state=state,
                        pid=rec.pid,
                    )
                )
        if checkpoints:
            for ref in refs:
                if ref.state in ("RUNNING", "STOPPING"):
                    newest = newest_checkpoint_mtime(self.runner.paths(ref.run_id).checkpoints)
                    ref.last_checkpoint_unix = newest or 0.0
        return refs

    def live_attempt(self, run_id: str, token: int) -> tuple[RunRecord, RunHandle]:
        """The record and handle of ``run_id`` while it runs here under ``token`` (an exec
        session's target).

        Raises:
            LookupError: not running here (never, not yet, or no longer; a stop in progress
                counts as no longer), or under another token (message says which).
        """
        with self._lock:
            rec = self.log.runs.get(run_id)
            h = self._handles.get(run_id)
            if rec is None or rec.status != RunStatus.RUNNING or h is None:
                raise LookupError(f"run {run_id} is not running on this node")
            if rec.token != token:
                raise LookupError(f"run {run_id} runs under another token than {token}")
            if rec.stop_requested:
                raise LookupError(f"run {run_id} is being stopped")
            return rec, h

    def free_gpus(self) -> int:
        """GPUs of this node not held by a live attempt."""
        with self._lock:
            held = {g for r in self.log.runs.values() if r.status in _LIVE for g in r.gpu_ids}
        return len([g for g in self.inventory.gpus if g.index not in held])

    def health(self) -> str:
        """``HEALTHY``, or what is wrong: ``UNKILLABLE: ...`` (attempts that survive SIGKILL),
        ``node unhealthy: gpu: ...`` (an NVML check failed), ``node unhealthy: disk: ...``
        (below the reserve, or full at start: see :meth:`compact_log`)."""
        with self._lock:
            stuck = sorted(rid for rid, h in self._handles.items() if h.unkillable)
        if stuck:
            return f"UNKILLABLE: {','.join(stuck)} survive SIGKILL"
        gpu = self.gpu_health.problem() if self.gpu_health is not None else None
        if gpu:
            return f"node unhealthy: gpu: {gpu}"
        disk = self.disk_problem()
        if self.compaction_deferred is not None and self._retry_compaction():
            disk = disk or f"node unhealthy: disk: {self.compaction_deferred}"
        return disk or "HEALTHY"

    def _retry_compaction(self) -> bool:
        """Retry the compaction a full disk deferred at start; True while it still fails."""
        try:
            self.log.compact()
        except OSError as exc:
            if not is_disk_full(exc):
                logger.error("assignment log: compaction failed: %s", exc)
            return True
        logger.info("disk space is back: the assignment log is compacted")
        self.compaction_deferred = None
        return False

    def disk_problem(self) -> str | None:
        """``node unhealthy: disk: ...`` when a state/scratch directory has less free space
        than the reserve, else None. Under that pressure the kept directories of reported
        attempts are removed first (:meth:`Runner.relieve`), then the space is measured
        again."""
        if self.disk_reserve_mb <= 0:
            return None
        free = self.runner.disk_free_mb()
        short = min(free.values(), default=self.disk_reserve_mb) < self.disk_reserve_mb
        if short and self.runner.relieve(self.disk_reserve_mb)[0]:
            free = self.runner.disk_free_mb()
        for path, mb in sorted(free.items()):
            if mb < self.disk_reserve_mb:
                return (
                    f"node unhealthy: disk: {path} has {mb} MiB free,"
                    f" below the reserve of {self.disk_reserve_mb} MiB"
                )
        return None

    def recent_start_failures(self, window_s: float = START_FAILURE_WINDOW_S) -> int:
        """Start failures the node caused in the last ``window_s`` seconds."""
        cutoff = time.monotonic() - window_s
        with self._lock:
            while self._node_start_failures and self._node_start_failures[0] < cutoff:
                self._node_start_failures.popleft()
            return len(self._node_start_failures)


def free_tcp_port() -> int:
    """A TCP port free on every interface of this node now, outside the kernel's ephemeral
    range (``gpufleet.netports``): the rendezvous of rank 0 binds it moments later, and no
    outgoing connection of the node can have taken it meanwhile."""
    return free_port("")


def _assign(result: int, message: str, pid: int = 0) -> pb.AssignJobResponse:
    return pb.AssignJobResponse(result=result, message=message, pid=pid)  # type: ignore[arg-type]


def _stop(result: int, message: str) -> pb.StopRunResponse:
    return pb.StopRunResponse(result=result, message=message)  # type: ignore[arg-type]
