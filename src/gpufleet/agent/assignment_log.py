"""The agent's durable memory: an append-only JSON-lines log of assignments and their lifecycle.

Every fact is appended (and fsynced) *before* the agent acts on it, so a restarted agent can
replay the log and know exactly which attempts it accepted, started, saw exit and reported —
and never start a logged run_id a second time (seed DD2: accept, start and confirm are three
separate durable facts).

Events, one JSON object per line, ``"e"`` naming the kind::

    assigned        the AssignJob request (run_id, job_id, token, gpu_ids, command, env, ...)
    started         pid (the command), boot_id, started_at_s, runtime ("process"/"container"),
                    runtime_state (the runtime's facts, e.g. cgroup paths, container name and
                    log follower), start_phases (pull/create/start seconds, warm/cold image);
                    process runtime also shim_pid == pgid, shim_start_ticks
    start_failed    message (the attempt is reported NEVER_STARTED)
    confirmed       result of ConfirmAssignment (CONFIRMED or REJECTED)
    stop_requested  reason, grace_s (survives a restart: the stop resumes)
    exited          exit_code, outcome (EXITED or STOPPED), finished_at_s, message, reason,
                    resources, stop_handshake
    uploaded        manifest_uri
    reported        result of ReportCompletion (ACCEPTED, STALE or REJECTED)
    tombstone       StopRun for a run never assigned here: a late AssignJob must not start it
    leader_epoch    the highest leader epoch heard from a controller
    run / job_token snapshot lines written by :meth:`AssignmentLog.compact`

**Which appends are fsynced.** Every line is written and flushed to the kernel before the agent
acts on it, so an agent crash (``kill -9``, the common failure) loses nothing: the page cache
outlives the process. ``fsync`` only adds survival of a power loss or kernel crash, and after
one of those nothing of an earlier attempt runs any more (a reboot changes the boot id). So only
the facts whose loss *across a reboot* would let the agent do something wrong are fsynced before
the agent acts: ``assigned`` (never start, or accept, a run_id twice), ``tombstone`` (a late
AssignJob must not start a stopped run), ``stop_requested`` and ``leader_epoch``. The
per-attempt progress lines (:data:`DEFERRED_SYNC`: ``started``, ``start_failed``,
``confirmed``, ``exited``, ``uploaded``, ``reported``) ride on the next fsync of the file (an
fsync makes every earlier line durable) or on :meth:`AssignmentLog.sync`; losing them in a power
cut only repeats idempotent work or loses an exit code the reboot would have lost anyway:
``started`` is re-learned from the shim's claim file, ``confirmed``/``reported`` by asking
the controller again (ConfirmAssignment and ReportCompletion are idempotent per run_id and
token), ``uploaded`` by uploading again, and an attempt whose ``exited`` line is lost is
reported as ended by the reboot (its job is retried; the controller answers STALE if the report
had already been accepted). Per attempt that is 1 fsync instead of 6.

Also here: the agent epoch (a counter file, one higher on every agent start) and, per job, the
highest fencing token seen (derived from ``assigned`` lines) used to reject stale tokens.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gpufleet.agent.fsutil import fsync_dir, write_json_atomic

logger = logging.getLogger("gpufleet.agent")

LOG_NAME = "assignments.jsonl"
DEFERRED_SYNC = frozenset(
    {"started", "start_failed", "confirmed", "exited", "uploaded", "reported"}
)
"""Events appended without their own fsync (see the module doc for why that is safe)."""
EPOCH_NAME = "agent_epoch"
REPORTED_RETENTION_S = 7 * 24 * 3600.0
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> bool:
    """True for an ``OSError`` saying the filesystem (or the user's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS


class RunStatus(enum.StrEnum):
    """Where one attempt is, as far as this node knows."""

    ASSIGNED = "ASSIGNED"  # logged; the start is in progress (or was, when the agent died)
    RUNNING = "RUNNING"  # the process group is alive (possibly being stopped)
    EXITED = "EXITED"  # the group is verified gone; exit code known; not yet reported
    FAILED_TO_START = "FAILED_TO_START"  # to be reported NEVER_STARTED
    REPORTED = "REPORTED"  # the controller answered ReportCompletion
    TOMBSTONED = "TOMBSTONED"  # stopped before it was ever assigned here: never start it


@dataclass(slots=True)
class RunRecord:
    """One attempt, rebuilt from the log. Times are seconds since the epoch (agent clock)."""

    run_id: str
    job_id: str = ""
    reservation_id: str = ""
    token: int = 0
    leader_epoch: int = 0
    attempt: int = 0
    gpu_ids: list[int] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    image: str = ""
    resume_from_uri: str = ""
    max_runtime_s: float = 0.0
    working_dir: str = ""
    memory_mb: int = 0  # host memory limit, MiB; 0 = none
    cpu: float = 0.0  # CPU cores (quota); 0 = none
    pids_limit: int = 0  # processes and threads at once; 0 = the agent's default
    disk_mb: int = 0  # scratch filesystem size, MiB; 0 = the agent's default
    # host paths mounted into a container: [{"source", "target", "read_only"}]
    mounts: list[dict[str, Any]] = field(default_factory=list)
    shm_size_mb: int = 0  # /dev/shm size, MiB; 0 = domain.mounts.default_shm_mb
    gpu_milli: int = 0  # a share of its one GPU, thousandths; 0 = whole GPUs
    gpu_sharing: str = "none"  # the node's sharing mode when it was assigned
    status: RunStatus = RunStatus.ASSIGNED
    assigned_at_s: float = 0.0
    pid: int = 0  # the user command
    shim_pid: int = 0  # leader of the process group: pgid == shim_pid
    shim_start_ticks: int = 0
    boot_id: str = ""  # /proc/sys/kernel/random/boot_id when started
    runtime: str = ""  # "process" or "container" ("" = process, logged before runtimes)
    runtime_state: dict[str, Any] = field(default_factory=dict)  # the runtime's own facts
    started_at_s: float = 0.0
    start_phases: dict[str, Any] = field(default_factory=dict)
    confirm_result: str = ""
    stop_reason: str = ""
    stop_grace_s: float = 0.0
    exit_code: int = 0
    outcome: str = ""  # EXITED, STOPPED or NEVER_STARTED
    finished_at_s: float = 0.0
    message: str = ""
    reason: str = ""  # machine-readable cause of the end, e.g. OOM_KILLED
    manifest_uri: str = ""
    report_result: str = ""
    node_fault: bool = False  # a start failure the node caused (not the job)
    # what it used (cgroup, NVML): peak_rss_bytes, cpu_seconds, gpu_util_pct,
    # gpu_mem_peak_bytes; each absent when not measured
    resources: dict[str, Any] = field(default_factory=dict)
    # a stop's checkpoint handshake (agent.checkpoint_signal.summary): signalled, grace_s,
    # signal_after_s, saved_s; empty when no SIGTERM was sent
    stop_handshake: dict[str, Any] = field(default_factory=dict)

    @property
    def pgid(self) -> int:
        return self.shim_pid

    @property
    def stop_requested(self) -> bool:
        return bool(self.stop_reason)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> RunRecord:
        known = {f.name for f in fields(RunRecord)}
        rec = RunRecord(**{k: v for k, v in data.items() if k in known})
        rec.status = RunStatus(rec.status)
        return rec


_ASSIGN_FIELDS = (
    "job_id",
    "reservation_id",
    "token",
    "leader_epoch",
    "attempt",
    "gpu_ids",
    "command",
    "env",
    "image",
    "resume_from_uri",
    "max_runtime_s",
    "working_dir",
    "memory_mb",
    "cpu",
    "pids_limit",
    "disk_mb",
    "mounts",
    "shm_size_mb",
    "gpu_milli",
    "gpu_sharing",
)


class AssignmentLog:
    """The log file plus the in-memory state replayed from it. Thread-safe.

    Args:
        state_dir: the agent's state directory (created if missing).

    Raises:
        OSError: the state directory is not writable.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / LOG_NAME
        self._lock = threading.Lock()
        self.runs: dict[str, RunRecord] = {}
        self.job_tokens: dict[str, int] = {}
        self.leader_epoch = 0
        self._replay()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (lives with self)
        self._unsynced = False

    # ------------------------------------------------------------------ agent epoch

    def bump_agent_epoch(self) -> int:
        """Increment and durably store the agent epoch; returns it (1 on the first start).

        On a full disk the new value is written over the old one in place (it fits in the
        block the file already has: a few digits), fsynced, instead of through a new file
        and a rename, so an agent restarted on a full disk still starts.

        Raises:
            OSError: the epoch cannot be stored (e.g. a full disk and no epoch file yet).
        """
        path = self.state_dir / EPOCH_NAME
        try:
            epoch = int(path.read_text().strip() or 0) + 1
        except FileNotFoundError:
            epoch = 1
        try:
            write_json_atomic(path, epoch)
        except OSError as exc:
            if not is_disk_full(exc) or epoch == 1:
                raise
            with open(path, "r+b") as f:
                f.write(json.dumps(epoch).encode())
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
        return epoch

    def stored_agent_epoch(self) -> int:
        """The agent epoch this state dir holds (the running agent's once it bumped it, else
        the last agent's; 0 = none: a new or wiped state dir). Read only."""
        try:
            return int((self.state_dir / EPOCH_NAME).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def held_runs(self) -> list[RunRecord]:
        """The attempts this node still holds: logged and not yet seen reported (assigned,
        running, exited or failed to start, their report not answered). A rejoin names them
        (``JoinRequest.held_runs``) so the controller keeps them."""
        with self._lock:
            return [
                rec
                for rec in self.runs.values()
                if rec.status not in (RunStatus.REPORTED, RunStatus.TOMBSTONED)
            ]

    # ------------------------------------------------------------------ appends

    def append(self, event: str, run_id: str | None = None, **data: Any) -> None:
        """Append one event (write, flush to the kernel; fsync unless it is one of
        :data:`DEFERRED_SYNC`, see the module doc) and apply it to the in-memory state.

        Raises:
            OSError: the write or fsync failed; the caller must not act on the event.
        """
        line: dict[str, Any] = {"e": event, "at_s": time.time()}
        if run_id is not None:
            line["run_id"] = run_id
        line.update(data)
        with self._lock:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._file.flush()
            if event in DEFERRED_SYNC:
                self._unsynced = True
            else:
                os.fsync(self._file.fileno())
                self._unsynced = False
            self._apply(line)

    def sync(self) -> None:
        """fsync the lines appended without one (cheap when there are none).

        Raises:
            OSError: the fsync failed.
        """
        with self._lock:
            if self._unsynced:
                os.fsync(self._file.fileno())
                self._unsynced = False

    def note(self, event: str, run_id: str | None = None, **data: Any) -> bool:
        """Append durably if the disk allows; if not (ENOSPC, EIO), apply the event in memory
        only and return False. For facts that must not be lost while the agent runs (an exit
        code, a report's answer) even on a full disk; a restart then re-learns them from the
        controller and the exit file. Never use it for ``assigned``."""
        try:
            self.append(event, run_id, **data)
            return True
        except OSError as exc:
            logger.error("assignment log: %s not durable (%s); kept in memory", event, exc)
            line: dict[str, Any] = {"e": event, "at_s": time.time(), **data}
            if run_id is not None:
                line["run_id"] = run_id
            with self._lock:
                self._apply(line)
            return False

    def close(self) -> None:
        with self._lock:
            if self._unsynced:
                with contextlib.suppress(OSError):
                    os.fsync(self._file.fileno())
            self._file.close()

    # ------------------------------------------------------------------ replay

    def _replay(self) -> None:
        """Apply every complete line. A bad *last* line is a torn append from a crash: it is
        dropped and truncated away. A bad line before good ones is corruption: raise."""
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        segments = raw.split(b"\n")
        nonblank = {i for i, seg in enumerate(segments) if seg.strip(b"\0 \t\r")}
        last = max(nonblank, default=-1)
        offset = 0
        for i, seg in enumerate(segments):
            if i in nonblank:
                complete = i < len(segments) - 1  # followed by a newline
                try:
                    if not complete:
                        raise ValueError("no newline")
                    line = json.loads(seg)
                except ValueError:
                    if i != last:
                        raise ValueError(
                            f"{self.path}: corrupt assignment log line {i + 1}"
                        ) from None
                    logger.warning("dropping a torn last line of %s (crash mid-append)", self.path)
                    with open(self.path, "r+b") as f:
                        f.truncate(offset)
                        os.fsync(f.fileno())
                    return
                self._apply(line)
            offset += len(seg) + 1

    def _apply(self, line: dict[str, Any]) -> None:
        e = line["e"]
        at_s = float(line.get("at_s", 0.0))
        if e == "leader_epoch":
            self.leader_epoch = max(self.leader_epoch, int(line["epoch"]))
            return
        if e == "job_token":
            self._note_token(line["job_id"], int(line["token"]))
            return
        if e == "run":
            rec = RunRecord.from_json(line["run"])
            self.runs[rec.run_id] = rec
            return
        run_id = line["run_id"]
        if e == "assigned":
            rec = RunRecord(run_id=run_id, assigned_at_s=at_s)
            for name in _ASSIGN_FIELDS:
                if name in line:
                    setattr(rec, name, line[name])
            self.runs[run_id] = rec
            self._note_token(rec.job_id, rec.token)
            self.leader_epoch = max(self.leader_epoch, rec.leader_epoch)
            return
        if e == "tombstone":
            self.runs[run_id] = RunRecord(
                run_id=run_id,
                status=RunStatus.TOMBSTONED,
                assigned_at_s=at_s,
                finished_at_s=at_s,
                stop_reason=line.get("reason", ""),
            )
            return
        rec = self.runs[run_id]
        if e == "started":
            rec.status = RunStatus.RUNNING
            rec.pid = int(line["pid"])
            rec.shim_pid = int(line.get("shim_pid", 0))
            rec.shim_start_ticks = int(line.get("shim_start_ticks", 0))
            rec.runtime = str(line.get("runtime", ""))
            rec.runtime_state = dict(line.get("runtime_state") or {})
            rec.boot_id = str(line.get("boot_id", ""))
            rec.started_at_s = float(line.get("started_at_s", at_s))
            rec.start_phases = dict(line.get("start_phases") or {})
        elif e == "start_failed":
            rec.status = RunStatus.FAILED_TO_START
            rec.outcome = "NEVER_STARTED"
            rec.message = line.get("message", "")
            rec.node_fault = bool(line.get("node_fault", False))
            rec.finished_at_s = at_s
        elif e == "confirmed":
            rec.confirm_result = line["result"]
        elif e == "stop_requested":
            rec.stop_reason = line["reason"]
            rec.stop_grace_s = float(line["grace_s"])
        elif e == "exited":
            rec.status = RunStatus.EXITED
            rec.exit_code = int(line["exit_code"])
            rec.outcome = line["outcome"]
            rec.finished_at_s = float(line.get("finished_at_s", at_s))
            rec.message = line.get("message", "")
            rec.reason = line.get("reason", "")
            rec.resources = dict(line.get("resources") or {})
            rec.stop_handshake = dict(line.get("stop_handshake") or {})
        elif e == "uploaded":
            rec.manifest_uri = line["manifest_uri"]
        elif e == "reported":
            rec.status = RunStatus.REPORTED
            rec.report_result = line["result"]
        else:
            logger.warning("ignoring unknown assignment log event %r", e)

    def _note_token(self, job_id: str, token: int) -> None:
        if token > self.job_tokens.get(job_id, -1):
            self.job_tokens[job_id] = token

    # ------------------------------------------------------------------ compaction

    def compact(self, *, now_s: float | None = None) -> None:
        """Rewrite the log as one snapshot line per run (plus job tokens and the leader epoch),
        dropping runs reported more than a week ago. Their jobs' highest tokens are kept, so a
        replayed old assignment is still rejected as stale.

        Atomic: written to a temporary file, fsynced, renamed over the log. It needs free
        space for the whole snapshot (:meth:`compact_size`) while the old log still exists.

        Raises:
            OSError: the snapshot could not be written (e.g. ENOSPC: see
                :func:`is_disk_full`); the log is unchanged and the temporary file removed.
        """
        now_s = time.time() if now_s is None else now_s
        with self._lock:
            keep, text = self._snapshot(now_s)
            tmp = self.path.with_name(self.path.name + ".compact")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            # lines a full disk refused may still sit in the buffer; the snapshot has them
            with contextlib.suppress(OSError):
                self._file.close()
            os.replace(tmp, self.path)
            fsync_dir(self.state_dir)
            self.runs = keep
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._unsynced = False  # the compacted file was fsynced whole

    def compact_size(self, *, now_s: float | None = None) -> int:
        """Bytes the snapshot :meth:`compact` writes (the free space it needs)."""
        with self._lock:
            return len(self._snapshot(time.time() if now_s is None else now_s)[1].encode())

    def _snapshot(self, now_s: float) -> tuple[dict[str, RunRecord], str]:
        """The runs a compaction keeps and the snapshot's text. Call with the lock held."""
        keep = {
            rid: rec
            for rid, rec in self.runs.items()
            if rec.status not in (RunStatus.REPORTED, RunStatus.TOMBSTONED)
            or now_s - rec.finished_at_s < REPORTED_RETENTION_S
        }
        lines = [json.dumps({"e": "leader_epoch", "epoch": self.leader_epoch})]
        lines += [
            json.dumps({"e": "job_token", "job_id": job_id, "token": token})
            for job_id, token in sorted(self.job_tokens.items())
        ]
        lines += [json.dumps({"e": "run", "run": rec.to_json()}) for rec in keep.values()]
        return keep, "".join(line + "\n" for line in lines)
