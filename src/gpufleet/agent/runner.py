"""Starting, adopting, watching and stopping attempts as host process groups.

This build runs commands directly as host processes under :mod:`gpufleet.agent.shim`; there is
no container runtime. ``image`` is accepted and recorded in the assignment log but not used.
Isolation is therefore by process group only: a command that leaves its group (``setsid``,
``setpgid``) escapes stop verification. A container or cgroup runtime would close that gap and
would slot in here, behind the same :class:`Runner` methods.

The per-attempt directory and environment are in :mod:`gpufleet.agent.workdir`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.agent import procfs
from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.fsutil import create_exclusive
from gpufleet.agent.workdir import RunPaths, StartError, build_env, download_prefix
from gpufleet.objectstore import ObjectStore

logger = logging.getLogger("gpufleet.agent")

SHIM_HANDSHAKE_TIMEOUT_S = 30.0
KILL_RESEND_S = 1.0
KILL_VERIFY_TIMEOUT_S = 30.0


@dataclass(slots=True)
class ProcessHandle:
    """A live attempt's process group plus the in-memory progress of a stop.

    ``popen`` is set only for shims this agent process spawned (it must reap them); adopted
    shims are children of PID 1. Times are ``time.monotonic()`` seconds.
    """

    shim_pid: int
    shim_start_ticks: int
    pid: int
    boot_id: str = ""
    popen: subprocess.Popen[bytes] | None = None
    term_sent_at: float | None = None
    kill_sent_at: float | None = None
    kill_resent_at: float | None = None
    main_exited: bool = False
    unkillable: bool = False

    @property
    def pgid(self) -> int:
        return self.shim_pid


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How an attempt ended, known only once its process group is verified gone.

    Attributes:
        exit_code: the command's status; negative = killed by that signal.
        finished_at_s: seconds since the epoch.
        never_started: the shim could not start the command (adoption after a restart).
        message: a note for the report (e.g. SIGKILL after grace).
    """

    exit_code: int
    finished_at_s: float
    never_started: bool = False
    message: str = ""


LOCAL_RUNS_KEPT = 20
"""Reported attempts whose local log directory is kept (see Runner.cleanup)."""
CLEANED_MARK = ".cleaned"


class Runner:
    """Process operations for attempts under ``{state_dir}/runs/``.

    Args:
        state_dir: the agent's state directory.
        store: where resume checkpoints are downloaded from.
    """

    def __init__(self, state_dir: Path, store: ObjectStore) -> None:
        self.runs_dir = state_dir / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.store = store

    def paths(self, run_id: str) -> RunPaths:
        return RunPaths(self.runs_dir / run_id)

    # ------------------------------------------------------------------ start

    def spawn(self, rec: RunRecord) -> ProcessHandle:
        """Prepare the directories, download the resume checkpoint and start the shim.

        Call only after the ``assigned`` event is durable, and at most once per run_id.

        Returns:
            The handle of the started process group.

        Raises:
            StartError: the command could not be started (empty, not found, not executable,
                resume download failed, ...). Nothing of it runs.
        """
        if not rec.command:
            raise StartError("empty command")
        paths = self.paths(rec.run_id)
        for d in (paths.work, paths.checkpoints, paths.artifacts):
            d.mkdir(parents=True, exist_ok=True)
        resume_dir: Path | None = None
        if rec.resume_from_uri:
            paths.resume.mkdir(parents=True, exist_ok=True)
            if download_prefix(self.store, rec.resume_from_uri, paths.resume) > 0:
                resume_dir = paths.resume
            else:
                logger.warning("run %s: nothing to resume at %s", rec.run_id, rec.resume_from_uri)
        env = build_env(rec, paths, resume_dir, dict(os.environ))
        fd = os.open(paths.env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(env, f)
        argv = [sys.executable, "-m", "gpufleet.agent.shim", "--exit-file", str(paths.exit_file)]
        argv += ["--log-file", str(paths.log), "--claim-file", str(paths.claim)]
        cwd = paths.work
        if rec.working_dir:
            cwd = Path(rec.working_dir)
            if not cwd.is_absolute() or not cwd.is_dir():
                raise StartError(
                    f"working_dir {rec.working_dir!r} is not a directory on this node"
                )
        argv += ["--env-file", str(paths.env_file), "--cwd", str(cwd)]
        read_fd, write_fd = os.pipe()
        try:
            with open(paths.shim_log, "ab") as shim_log:
                popen = subprocess.Popen(
                    [*argv, "--status-fd", str(write_fd), "--", *rec.command],
                    stdin=subprocess.DEVNULL,
                    stdout=shim_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the shim leads its own session and group
                    pass_fds=(write_fd,),
                )
        except (OSError, ValueError) as exc:  # ValueError: e.g. a NUL byte in an argument
            os.close(read_fd)
            raise StartError(
                f"cannot start the shim: {exc}", node_fault=isinstance(exc, OSError)
            ) from exc
        finally:
            os.close(write_fd)
        try:
            status = _read_status(read_fd, SHIM_HANDSHAKE_TIMEOUT_S)
        finally:
            os.close(read_fd)
        if status is not None and "error" in status:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=10)
            raise StartError(str(status["error"]))
        if status is None and popen.poll() is not None:
            raise StartError(
                f"the shim exited ({popen.returncode}); see {paths.shim_log}", node_fault=True
            )
        if status is None:
            logger.warning("run %s: no handshake from the shim in time; watching it", rec.run_id)
        claim = _read_json(paths.claim) or {}
        ticks = claim.get("start_ticks") or procfs.start_ticks(popen.pid) or 0
        child = int(status["pid"]) if status else popen.pid
        return ProcessHandle(popen.pid, int(ticks), child, procfs.boot_id(), popen=popen)

    def resolve_unstarted(self, rec: RunRecord) -> ProcessHandle | None:
        """After a restart, settle an attempt logged ``assigned`` but never ``started``.

        The agent may have died after spawning the shim but before logging it. The shim and
        this method race to create the claim file (see :mod:`gpufleet.agent.shim`).

        Returns:
            The shim's handle if the shim claimed the start (adopt it), or None if the start
            is now abandoned for good (report NEVER_STARTED).
        """
        paths = self.paths(rec.run_id)
        paths.root.mkdir(parents=True, exist_ok=True)
        if create_exclusive(paths.claim, {"abandoned": True}):
            return None
        claim = _read_json(paths.claim) or {}
        if "pid" not in claim:
            return None
        pid = int(claim["pid"])
        return ProcessHandle(pid, int(claim["start_ticks"]), pid, str(claim.get("boot_id", "")))

    @staticmethod
    def adopt(rec: RunRecord) -> ProcessHandle:
        """A handle for a logged, started attempt this agent process did not spawn."""
        return ProcessHandle(rec.shim_pid, rec.shim_start_ticks, rec.pid, rec.boot_id)

    # ------------------------------------------------------------------ watch and stop

    def poll(self, rec: RunRecord, h: ProcessHandle, now: float) -> ExitInfo | None:
        """One monitoring step: advance a requested stop and detect the end of the attempt.

        Stop protocol (seed DD5): SIGTERM to the group; after ``rec.stop_grace_s`` SIGKILL to
        the group; then the group must be *verified* gone. When the command ends on its own,
        whatever is left of its group is SIGKILLed too (container semantics). SIGKILL is re-sent
        every second while members remain; after 30 s ``h.unkillable`` is set (a wedged
        process, e.g. in uninterruptible sleep in a driver) and the attempt is never reported
        finished while it lasts.

        Args:
            rec: the attempt (``stop_reason``/``stop_grace_s`` set when a stop was requested).
            h: its handle, mutated with the stop's progress.
            now: ``time.monotonic()``.

        Returns:
            How it ended, once the group is verified gone; else None.
        """
        if h.boot_id and h.boot_id != procfs.boot_id():
            # Started before a reboot: nothing of it runs, and its pids mean nothing now.
            return self._exit_info(rec, h, rebooted=True)
        if rec.stop_requested and h.term_sent_at is None:
            logger.info("run %s: SIGTERM to group %d (%s)", rec.run_id, h.pgid, rec.stop_reason)
            self._signal(h, signal.SIGTERM)
            h.term_sent_at = now
        h.main_exited = h.main_exited or self._shim_exited(h)
        if (
            h.kill_sent_at is None
            and h.term_sent_at is not None
            and now - h.term_sent_at >= rec.stop_grace_s
        ):
            if not h.main_exited:
                logger.warning(
                    "run %s: alive after %g s grace: SIGKILL", rec.run_id, rec.stop_grace_s
                )
            self._kill(h, now)
        if not h.main_exited and h.kill_sent_at is None:
            return None
        if procfs.group_alive(h.pgid, h.shim_start_ticks):
            if h.kill_sent_at is None:
                self._kill(h, now)  # the command ended: the rest of its group goes with it
                return None
            if now - (h.kill_resent_at or now) >= KILL_RESEND_S:
                self._signal(h, signal.SIGKILL)
                h.kill_resent_at = now
            if now - h.kill_sent_at >= KILL_VERIFY_TIMEOUT_S and not h.unkillable:
                h.unkillable = True
                logger.error(
                    "run %s: group %d survives SIGKILL; not reporting it stopped",
                    rec.run_id,
                    h.pgid,
                )
            return None
        if h.popen is not None:
            h.popen.wait()  # reap the shim only now: a zombie leader keeps the pgid from reuse
        h.unkillable = False
        return self._exit_info(rec, h)

    @classmethod
    def _kill(cls, h: ProcessHandle, now: float) -> None:
        cls._signal(h, signal.SIGKILL)
        h.kill_sent_at = h.kill_resent_at = now

    @staticmethod
    def _signal(h: ProcessHandle, sig: int) -> None:
        procfs.signal_group(h.pgid, h.shim_start_ticks, sig)

    def _shim_exited(self, h: ProcessHandle) -> bool:
        if h.popen is not None:
            # WNOWAIT: see the exit but leave the zombie, so the pgid cannot be reused before
            # the rest of the group is verified gone.
            try:
                info = os.waitid(os.P_PID, h.shim_pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return True
            return info is not None
        return not procfs.is_same_process_alive(h.shim_pid, h.shim_start_ticks)

    def _exit_info(self, rec: RunRecord, h: ProcessHandle, *, rebooted: bool = False) -> ExitInfo:
        data = _read_json(self.paths(rec.run_id).exit_file)
        rc = h.popen.returncode if h.popen is not None else None
        if data is None and rc is not None and rc >= 0 and not rebooted:
            # the shim could not write its exit file (disk full) and exited with the code
            # (a negative rc: the shim itself was killed by a signal; handled below)
            return ExitInfo(
                exit_code=-(rc - 128) if rc > 128 else rc,
                finished_at_s=time.time(),
                message="exit code from the shim's status (its exit file could not be written)",
            )
        if data is not None and "exit_code" in data:
            start_error = str(data.get("start_error", ""))
            return ExitInfo(
                exit_code=int(data["exit_code"]),
                finished_at_s=float(data.get("finished_at_s", time.time())),
                never_started=bool(start_error),
                message=start_error,
            )
        if rebooted:
            message = "the node rebooted while it ran; exit status lost"
        elif h.kill_sent_at is not None and h.term_sent_at is not None:
            message = f"killed with SIGKILL after {rec.stop_grace_s:g} s grace"
        else:
            message = "exit status lost (the shim was killed); assuming SIGKILL"
        return ExitInfo(exit_code=-signal.SIGKILL, finished_at_s=time.time(), message=message)

    def cleanup(self, run_id: str) -> None:
        """Remove an attempt's bulky local files once its completion was answered (its log
        and artifacts are uploaded by then). The log, exit file and claim stay for local
        debugging, for the ``LOCAL_RUNS_KEPT`` most recently cleaned attempts only: older
        attempt directories are removed whole (a bounded cache, so the disk cannot fill up
        with old logs)."""
        paths = self.paths(run_id)
        for d in (paths.work, paths.checkpoints, paths.artifacts, paths.resume):
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            (paths.root / CLEANED_MARK).touch()
        try:
            cleaned = sorted(
                (p.stat().st_mtime, p.parent) for p in self.runs_dir.glob(f"*/{CLEANED_MARK}")
            )
        except OSError:
            return
        for _, d in cleaned[: max(0, len(cleaned) - LOCAL_RUNS_KEPT)]:
            shutil.rmtree(d, ignore_errors=True)

    def disk_free_mb(self) -> dict[str, int]:
        """Free space of the state and scratch directories, MiB, by path."""
        out: dict[str, int] = {}
        for d in (self.runs_dir.parent, self.runs_dir):
            try:
                out[str(d)] = shutil.disk_usage(d).free // (1024 * 1024)
            except OSError:
                out[str(d)] = 0
        return out


def _read_status(fd: int, timeout_s: float) -> dict[str, Any] | None:
    """Read the shim's one-line JSON status; None on timeout or EOF without a line."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    if not buf.strip():
        return None
    try:
        data = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
