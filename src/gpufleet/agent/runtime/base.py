"""The job runtime interface: how the agent starts, adopts, watches and stops one attempt.

A *runtime* turns a prepared attempt (:class:`Launch`: directories made, resume checkpoint
downloaded, environment built, user and limits chosen) into something that runs, and later
says how it ended. The agent core never touches processes or containers itself; it calls:

``spawn(rec, launch) -> RunHandle``
    Start the attempt once. Called only after the ``assigned`` event is durable. Raises
    :class:`StartError` when nothing of it runs (reported NEVER_STARTED). The handle's
    :meth:`RunHandle.log_fields` are appended to the ``started`` event of the assignment log,
    and come back as ``rec.runtime_state`` after an agent restart.
``resolve_unstarted(rec) -> RunHandle | None``
    After a restart, an attempt logged ``assigned`` but not ``started``: adopt it if the start
    had gone through (return its handle), or make sure it never starts (return None).
``adopt(rec) -> RunHandle``
    After a restart, a handle for an attempt logged ``started`` (no side effects).
``poll(rec, handle, now) -> ExitInfo | None``
    One monitoring step, every ~50 ms. Advances a requested stop and detects the end. The
    stop protocol is the same for every runtime (seed DD5): when ``rec.stop_requested``,
    SIGTERM to *every* process of the attempt; after ``rec.stop_grace_s`` seconds, or as soon
    as the job signalled its checkpoint durable (``handle.checkpoint_done_at``, the handshake
    of :mod:`gpufleet.agent.checkpoint_signal`; :func:`grace_over`), SIGKILL to every
    process; then the attempt must be *verified gone* (no process of it left). When the
    main process ends on its own, whatever else is left of the attempt is killed too (container
    semantics). Return :class:`ExitInfo` only once verified gone; before that, None. Set
    ``handle.unkillable`` when processes survive SIGKILL for ``KILL_VERIFY_TIMEOUT_S`` (the
    node then reports itself unhealthy) and never return while they last.
``release(rec)``
    Free what the runtime holds for a finished attempt (cgroup, container record). Called once
    the completion was answered; must be idempotent.

Which runtime serves a job: ``container`` when the job has an ``image``, ``process``
otherwise (:class:`gpufleet.agent.runtime.Runtimes`). A node without a container runtime
fails image jobs at start with :data:`NO_CONTAINER_RUNTIME`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from gpufleet.agent.workdir import RunPaths, StartError
from gpufleet.domain.mounts import Mount

if TYPE_CHECKING:
    from gpufleet.agent.assignment_log import RunRecord

__all__ = [
    "KILL_RESEND_S",
    "KILL_VERIFY_TIMEOUT_S",
    "NO_CONTAINER_RUNTIME",
    "OOM_KILLED",
    "ExitInfo",
    "JobUser",
    "Launch",
    "RunHandle",
    "Runtime",
    "StartError",
    "grace_over",
]

KILL_RESEND_S = 1.0
"""SIGKILL is re-sent this often (seconds) while processes of a stopped attempt remain."""
KILL_VERIFY_TIMEOUT_S = 30.0
"""After this long (seconds) past the first SIGKILL, the attempt is marked unkillable."""
OOM_KILLED = "OOM_KILLED"
"""``ExitInfo.reason`` when the kernel killed the attempt for exceeding ``memory_mb``."""
NO_CONTAINER_RUNTIME = "image jobs need a container runtime on this node"


@dataclass(frozen=True, slots=True)
class JobUser:
    """The identity an attempt's command runs as.

    Attributes:
        uid, gid: numeric ids (the command's real and effective ids).
        groups: supplementary group ids (empty: none).
        name: for messages and ``gpufleet nodes``.
        home: value of ``HOME`` for the command.
        switch: False when the agent cannot change users (not root): the command then runs as
            the agent's own user and ``uid``/``gid`` are the agent's.
    """

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    name: str = ""
    home: str = ""
    switch: bool = True


@dataclass(frozen=True, slots=True)
class Launch:
    """Everything a runtime needs to start one attempt; built by the agent, runtime-neutral.

    Attributes:
        paths: the attempt's directories and files (work, checkpoints, artifacts, resume,
            output log, ...); all exist, the job-visible ones owned by ``user``.
        command: argv (a container runtime runs it inside the image).
        env: the complete environment of the command (already allow-listed; a container
            runtime passes exactly this, rewriting the GPUFLEET_*_DIR paths to its mounts).
        cwd: working directory on the host (the attempt's work dir or the job's working_dir).
        user: who the command runs as.
        memory_mb: host memory limit in MiB; 0 = no limit.
        cpu: CPU cores (quota); 0 = no limit.
        gpu_ids: the reservation's GPU indexes (CUDA_VISIBLE_DEVICES is already in ``env``).
        resume_dir: the downloaded checkpoint dir, or None.
        pids_max: processes and threads at once (the job's ``pids_limit``, else the node's
            ``--job-pids-max``); 0 = no limit.
        mounts: host paths to mount into a container (checked against the node's
            ``--allow-mount``, sources resolved); always empty for a process job.
        shm_mb: size of the attempt's ``/dev/shm``, MiB; 0 = the runtime's own default.
    """

    paths: RunPaths
    command: tuple[str, ...]
    env: dict[str, str]
    cwd: Path
    user: JobUser
    memory_mb: int = 0
    cpu: float = 0.0
    gpu_ids: tuple[int, ...] = ()
    resume_dir: Path | None = None
    pids_max: int = 0
    mounts: tuple[Mount, ...] = ()
    shm_mb: int = 0


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How an attempt ended, known only once it is verified gone.

    Attributes:
        exit_code: the command's status; negative = killed by that signal.
        finished_at_s: seconds since the epoch.
        never_started: the runtime could not start the command (adoption after a restart).
        message: a note for the report (e.g. SIGKILL after grace, memory limit).
        reason: a machine-readable cause, "" or :data:`OOM_KILLED`; it is carried in the
            completion report and becomes the job's failure reason.
        resources: what the attempt used, from its cgroup (``JobCgroup.usage``:
            ``peak_rss_bytes``, ``cpu_seconds``); empty when not measured.
        stop_handshake: see the field.
    """

    exit_code: int
    finished_at_s: float
    never_started: bool = False
    message: str = ""
    reason: str = ""
    resources: Mapping[str, int | float] = field(default_factory=dict)
    stop_handshake: Mapping[str, Any] = field(default_factory=dict)
    """A stop's checkpoint handshake (:func:`gpufleet.agent.checkpoint_signal.summary`:
    ``signalled``, ``grace_s``, ``signal_after_s``, ``saved_s``); empty when no SIGTERM
    was sent (the attempt ended on its own)."""


@dataclass(slots=True, kw_only=True)
class RunHandle:
    """A live attempt plus the in-memory progress of a stop (common to all runtimes).

    Runtimes subclass it with their own fields (pids, cgroup, container name). Times are
    ``time.monotonic()`` seconds.

    Attributes:
        pid: the command's pid as this node sees it (0 = unknown); reported to the controller.
        boot_id: ``/proc/sys/kernel/random/boot_id`` at start ("" = unknown); a handle from an
            earlier boot is dead by definition.
        term_sent_at / kill_sent_at / kill_resent_at: stop progress.
        checkpoint_done_at: when the agent saw the job's checkpoint signal after SIGTERM
            (``$GPUFLEET_CHECKPOINT_DONE``); None = not (yet) signalled.
        main_exited: the main process has ended.
        unkillable: processes survived SIGKILL for ``KILL_VERIFY_TIMEOUT_S``.
    """

    runtime: ClassVar[str] = ""
    pid: int = 0
    boot_id: str = ""
    term_sent_at: float | None = None
    kill_sent_at: float | None = None
    kill_resent_at: float | None = None
    checkpoint_done_at: float | None = None
    main_exited: bool = False
    unkillable: bool = False

    def log_fields(self) -> dict[str, Any]:
        """JSON fields for the ``started`` event: ``pid``, ``boot_id`` and ``runtime_state``
        (a dict the runtime reads back in :meth:`Runtime.adopt`)."""
        return {"pid": self.pid, "boot_id": self.boot_id, "runtime_state": {}}


def grace_over(rec: RunRecord, h: RunHandle, now: float) -> bool:
    """Whether a stop's grace has ended at ``now`` (monotonic seconds): SIGTERM was sent and
    either ``rec.stop_grace_s`` seconds passed or the job signalled its checkpoint durable
    (``h.checkpoint_done_at``), whichever came first. Shared by every runtime's ``poll``."""
    if h.term_sent_at is None:
        return False
    return h.checkpoint_done_at is not None or now - h.term_sent_at >= rec.stop_grace_s


class Runtime(Protocol):
    """One way of running attempts (see the module doc for the contract of each method).

    Attributes:
        kind: ``"process"`` or ``"container"``; logged with each attempt so a restarted agent
            adopts it with the runtime that started it.
    """

    kind: str

    def spawn(self, rec: RunRecord, launch: Launch) -> RunHandle: ...

    def resolve_unstarted(self, rec: RunRecord, paths: RunPaths) -> RunHandle | None: ...

    def adopt(self, rec: RunRecord, paths: RunPaths) -> RunHandle: ...

    def poll(self, rec: RunRecord, h: RunHandle, now: float) -> ExitInfo | None: ...

    def release(self, rec: RunRecord) -> None: ...

    def describe(self) -> str:
        """One line for ``gpufleet nodes`` and the agent's start log (e.g. the containment)."""
        ...
