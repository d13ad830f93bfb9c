"""The ``process`` runtime: the command as a host process under a per-attempt shim.

The shim (:mod:`gpufleet.agent.shim`) leads its own session and process group, outlives an
agent crash, records the exit code, and puts the command (not itself) into the attempt's
cgroup before exec (:mod:`.containment`). What "the attempt's processes" means depends on the
node's containment:

* a cgroup (v1 or v2): every pid in the group, whatever its session or process group, so a
  ``setsid`` child is stopped and waited for like the rest; *verified gone* = the group is
  empty (and the shim has exited);
* ``pidns``: the process group of the shim, ``unshare`` and the namespace's init; when the init
  dies the kernel kills the rest of the namespace, and ``unshare`` only exits after that;
* ``none``: the process group only (a ``setsid`` child escapes; said at agent start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gpufleet.agent import procfs, shim
from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.fsutil import create_exclusive
from gpufleet.agent.runtime import jobns
from gpufleet.agent.runtime.base import (
    KILL_RESEND_S,
    KILL_VERIFY_TIMEOUT_S,
    OOM_KILLED,
    ExitInfo,
    Launch,
    RunHandle,
    StartError,
    grace_over,
)
from gpufleet.agent.runtime.containment import Containment, JobCgroup, oom_verdict
from gpufleet.agent.runtime.jobnet import JobNet, attempt_netns, drop_netns
from gpufleet.agent.runtime.jobns import Isolation
from gpufleet.agent.workdir import RunPaths

logger = logging.getLogger("gpufleet.agent")

SHIM_HANDSHAKE_TIMEOUT_S = 30.0


@dataclass(slots=True, kw_only=True)
class ProcessHandle(RunHandle):
    """A live process attempt. ``popen`` is set only for shims this agent process spawned (it
    must reap them); adopted shims are children of PID 1. ``cgroup`` is None without cgroup
    containment."""

    runtime: ClassVar[str] = "process"
    shim_pid: int
    shim_start_ticks: int
    exit_file: Path
    popen: subprocess.Popen[bytes] | None = None
    cgroup: JobCgroup | None = None

    @property
    def pgid(self) -> int:
        return self.shim_pid

    def log_fields(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.cgroup is not None:
            state["cgroup"] = self.cgroup.to_json()
        return {
            "pid": self.pid,
            "boot_id": self.boot_id,
            "shim_pid": self.shim_pid,
            "shim_start_ticks": self.shim_start_ticks,
            "runtime_state": state,
        }


class ProcessRuntime:
    """Host processes, contained as the node allows (see module doc).

    Args:
        containment: what :func:`.containment.detect` found at agent start.
        isolation: what :func:`.jobns.detect` found (no_new_privs, mount namespace, hidden
            /proc); default: none (tests of the agent logic).
    """

    kind = "process"

    def __init__(
        self,
        containment: Containment,
        isolation: Isolation | None = None,
        jobnet: JobNet | None = None,
    ) -> None:
        self.containment = containment
        self.isolation = isolation or Isolation()
        self.jobnet = jobnet

    def describe(self) -> str:
        return self.containment.kind

    def shim_argv(self, launch: Launch, **shim_args: Any) -> list[str]:
        """The shim's full command line: the isolation prefix (``setpriv --no-new-privs``,
        ``unshare --mount --ipc``: :mod:`.jobns`) and the shim with its mount options. The one
        place that decides what wraps an attempt's shim."""
        namespace = launch.user.switch  # jobs as the agent's own user: no isolation promised
        iso = self.isolation
        options = iso.shim_options(namespace=namespace, tmp_dir=str(launch.paths.tmp))
        if options:  # the attempt's private /dev/shm, of the job's size
            options["shm_mb"] = launch.shm_mb
        return [*iso.shim_prefix(namespace=namespace), *shim.argv(**shim_args, **options)]

    # ------------------------------------------------------------------ start

    def spawn(self, rec: RunRecord, launch: Launch) -> RunHandle:
        """Create the cgroup, start the shim, wait for its handshake.

        Raises:
            StartError: nothing of the command runs (the message says why, e.g. a
                working_dir the job user cannot enter, or a command that is not found).
        """
        paths = launch.paths
        cgroup = self.containment.group_for(rec.run_id, cpu_quota=launch.cpu > 0)
        if cgroup is not None:
            try:
                cgroup.create(memory_mb=launch.memory_mb, cpu=launch.cpu, pids_max=launch.pids_max)
            except OSError as exc:
                cgroup.remove()
                raise StartError(
                    f"cannot create the attempt's cgroup: {exc}", node_fault=True
                ) from exc
        command = list(launch.command)
        user = launch.user
        ids: dict[str, Any] = {}
        env, hidden = dict(launch.env), tuple[str, ...]()
        if user.switch:  # the shim and its helpers run as root: no loader variable for them
            env, hidden = jobns.hide_loader_env(launch.env)
        if self.containment.kind == "pidns":
            # unshare must run privileged to make the namespace; it switches users itself
            prefix_ids = {"uid": user.uid, "gid": user.gid} if user.switch else {}
            if hidden:  # set back by a shim stage that unshare runs as the job user (the script
                # on its stdin: the job user may not be able to read the package's files)
                command = [*shim.stage2_argv(restore_env=hidden), *command]
                ids["script_stdin"] = True
            command = [*self.containment.command_prefix(**prefix_ids), *command]
            if user.switch:
                ids["cwd_as"] = (user.uid, user.gid)
        elif user.switch:
            ids.update(uid=user.uid, gid=user.gid, groups=tuple(user.groups))
            ids["restore_env"] = hidden
        # the attempt's network namespace: the shim (root) runs in it, so the command does
        try:
            netns = attempt_netns(self.jobnet, rec.run_id, launch.env)
        except StartError:
            if cgroup is not None:
                cgroup.remove()
            raise
        read_fd, write_fd = os.pipe()
        try:
            with open(paths.shim_log, "ab") as shim_log:
                popen = subprocess.Popen(
                    netns
                    + self.shim_argv(
                        launch,
                        exit_file=paths.exit_file,
                        log_file=paths.log,
                        claim_file=paths.claim,
                        status_fd=1,  # its stdout: the pipe
                        cwd=launch.cwd,
                        # the attempt's own work dir belongs to the job user; a working_dir
                        # the job chose is entered only as the job user
                        cwd_check=launch.cwd != paths.work,
                        cgroup_procs=tuple(cgroup.procs_files()) if cgroup is not None else (),
                        command=command,
                        keep_pwd="PWD" in launch.env or "OLDPWD" in launch.env,
                        **ids,
                    ),
                    stdin=subprocess.DEVNULL,
                    stdout=write_fd,
                    stderr=shim_log,
                    start_new_session=True,  # the shim leads its own session and group
                    env=env,  # the shell's environment is the command's (loader vars hidden)
                )
        except (OSError, ValueError) as exc:  # ValueError: e.g. a NUL byte in an argument
            os.close(read_fd)
            if cgroup is not None:
                cgroup.remove()
            drop_netns(self.jobnet, rec.run_id)
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
            if cgroup is not None:
                cgroup.remove()
            drop_netns(self.jobnet, rec.run_id)
            raise StartError(str(status["error"]))
        if status is None and popen.poll() is not None:
            raise StartError(
                f"the shim exited ({popen.returncode}){_last_line(paths.shim_log)}; "
                f"see {paths.shim_log}",
                node_fault=True,
            )
        if status is None:
            logger.warning("run %s: no handshake from the shim in time; watching it", rec.run_id)
        claim = _read_claim(paths.claim) or {}
        ticks = claim.get("start_ticks") or procfs.start_ticks(popen.pid) or 0
        child = int(status["pid"]) if status else popen.pid
        return ProcessHandle(
            pid=child,
            boot_id=procfs.boot_id(),
            shim_pid=popen.pid,
            shim_start_ticks=int(ticks),
            exit_file=paths.exit_file,
            popen=popen,
            cgroup=cgroup,
        )

    def resolve_unstarted(self, rec: RunRecord, paths: RunPaths) -> RunHandle | None:
        """After a restart, settle an attempt logged ``assigned`` but never ``started``: the
        shim and this method race to create the claim file (see :mod:`gpufleet.agent.shim`).

        Returns:
            The shim's handle if the shim claimed the start (adopt it), or None if the start
            is now abandoned for good (report NEVER_STARTED).
        """
        paths.root.mkdir(parents=True, exist_ok=True)
        if create_exclusive(paths.claim, {"abandoned": True}):
            self._remove_group(rec.run_id)
            drop_netns(self.jobnet, rec.run_id)
            return None
        claim = _read_claim(paths.claim) or {}
        if "pid" not in claim:
            return None
        pid = int(claim["pid"])
        cgroup = self.containment.group_for(rec.run_id, cpu_quota=rec.cpu > 0)
        return ProcessHandle(
            pid=pid,
            boot_id=str(claim.get("boot_id", "")),
            shim_pid=pid,
            shim_start_ticks=int(claim["start_ticks"]),
            exit_file=paths.exit_file,
            cgroup=cgroup if cgroup is not None and cgroup.exists() else None,
        )

    def adopt(self, rec: RunRecord, paths: RunPaths) -> RunHandle:
        """A handle for a logged, started attempt this agent process did not spawn."""
        cg = rec.runtime_state.get("cgroup")
        return ProcessHandle(
            pid=rec.pid,
            boot_id=rec.boot_id,
            shim_pid=rec.shim_pid,
            shim_start_ticks=rec.shim_start_ticks,
            exit_file=paths.exit_file,
            cgroup=JobCgroup.from_json(cg) if cg else None,
        )

    def release(self, rec: RunRecord) -> None:
        cg = rec.runtime_state.get("cgroup")
        if cg:
            JobCgroup.from_json(cg).remove()
        drop_netns(self.jobnet, rec.run_id)

    def _remove_group(self, run_id: str) -> None:
        cgroup = self.containment.group_for(run_id, cpu_quota=True)
        if cgroup is not None:
            cgroup.remove()

    # ------------------------------------------------------------------ watch and stop

    def poll(self, rec: RunRecord, h: RunHandle, now: float) -> ExitInfo | None:
        """One monitoring step (the stop protocol of :mod:`.base`).

        SIGTERM goes to every process of the attempt (the cgroup's pids, else the shim's
        group); after ``rec.stop_grace_s`` (or the job's checkpoint signal) SIGKILL to every
        process (cgroup: frozen first, so nothing forks in between); re-sent every second
        while any is left; after 30 s
        ``h.unkillable`` is set and the attempt is never reported finished while it lasts.
        """
        assert isinstance(h, ProcessHandle)
        if h.boot_id and h.boot_id != procfs.boot_id():
            # Started before a reboot: nothing of it runs, and its pids mean nothing now.
            return self._exit_info(rec, h, rebooted=True)
        if rec.stop_requested and h.term_sent_at is None:
            logger.info("run %s: SIGTERM to %s (%s)", rec.run_id, _what(h), rec.stop_reason)
            self._signal(h, signal.SIGTERM)
            h.term_sent_at = now
        h.main_exited = h.main_exited or self._shim_exited(h)
        if h.kill_sent_at is None and grace_over(rec, h, now):
            if not h.main_exited and h.checkpoint_done_at is not None:
                logger.info("run %s: checkpoint signalled: SIGKILL what is left", rec.run_id)
            elif not h.main_exited:
                logger.warning(
                    "run %s: alive after %g s grace: SIGKILL", rec.run_id, rec.stop_grace_s
                )
            self._kill(h, now)
        if not h.main_exited and h.kill_sent_at is None:
            return None
        if self._alive(h):
            if h.kill_sent_at is None:
                self._kill(h, now)  # the command ended: the rest of the attempt goes with it
                return None
            if now - (h.kill_resent_at or now) >= KILL_RESEND_S:
                self._kill(h, now, resend=True)
            if now - h.kill_sent_at >= KILL_VERIFY_TIMEOUT_S and not h.unkillable:
                h.unkillable = True
                logger.error(
                    "run %s: %s survives SIGKILL; not reporting it stopped", rec.run_id, _what(h)
                )
            return None
        if not h.main_exited:
            return None  # the cgroup is empty; the shim is writing the exit file
        h.unkillable = False
        info = self._exit_info(rec, h)
        if h.cgroup is not None:
            h.cgroup.remove()
        drop_netns(self.jobnet, rec.run_id)  # nothing of the attempt is left in it
        return info

    def _alive(self, h: ProcessHandle) -> bool:
        if h.cgroup is not None:
            # the shim is outside the group; a shim killed by hand leaves the command in it
            return bool(h.cgroup.pids())
        return procfs.group_alive(h.pgid, h.shim_start_ticks)

    def _kill(self, h: ProcessHandle, now: float, *, resend: bool = False) -> None:
        if h.cgroup is not None:
            h.cgroup.kill_all()
        else:
            self._signal(h, signal.SIGKILL)
        if not resend:
            h.kill_sent_at = now
        h.kill_resent_at = now

    @staticmethod
    def _signal(h: ProcessHandle, sig: int) -> None:
        if h.cgroup is not None:
            h.cgroup.signal_all(sig)
        else:
            procfs.signal_group(h.pgid, h.shim_start_ticks, sig)

    @staticmethod
    def _shim_exited(h: ProcessHandle) -> bool:
        if h.popen is not None:
            # Reaps the shim at once. Its zombie used to be kept so that its pid could not be
            # reused as a pgid, but that made ``killpg(pgid, 0)`` succeed after every attempt
            # and forced a scan of every /proc/<pid>/stat on the host. Reaping is safe: the
            # kernel frees the number only once no process uses it as pid *or* pgid (the group
            # is empty, so nothing is left to signal), and a number reused after that (a wrap
            # of pid_max) is recognised by its start time (``procfs.leader_reused``).
            return h.popen.poll() is not None
        return not procfs.is_same_process_alive(h.shim_pid, h.shim_start_ticks)

    def _exit_info(self, rec: RunRecord, h: ProcessHandle, *, rebooted: bool = False) -> ExitInfo:
        info = self._exit_status(rec, h, rebooted=rebooted)
        if h.cgroup is None or rebooted or info.never_started:
            return info
        return dataclasses.replace(info, resources=h.cgroup.usage())  # before its removal

    def _exit_status(
        self, rec: RunRecord, h: ProcessHandle, *, rebooted: bool = False
    ) -> ExitInfo:
        data = _read_json(h.exit_file)
        reason, note = "", ""
        # the OOM rule shared with the container runtime (containment.oom_verdict): the
        # kernel's OOM-kill counter of the attempt's group, and a command that failed
        kills = h.cgroup.oom_kills() if h.cgroup is not None else -1
        if kills < 0 and h.cgroup is not None and h.cgroup.oom_killed():
            kills = 1  # a kernel without the counter (< 4.13): the limit was hit
        if kills > 0:
            assert h.cgroup is not None
            limit = h.cgroup.memory_limit_mb() or rec.memory_mb
            reason = OOM_KILLED
            note = (
                f"OOM_KILLED: the attempt exceeded its memory limit (memory_mb={limit}) and "
                "the kernel killed it"
            )
        rc = h.popen.returncode if h.popen is not None else None
        if data is None and rc is not None and rc >= 0 and not rebooted:
            # the shim could not write its exit file (disk full) and exited with the code
            # (a negative rc: the shim itself was killed by a signal; handled below)
            code = shim.exit_code_from_status(rc)
            return ExitInfo(
                exit_code=code,
                finished_at_s=time.time(),
                message=(note if oom_verdict(kills, code) else "")
                or "exit code from the shim's status (its exit file could not be written)",
                reason=reason if oom_verdict(kills, code) else "",
            )
        if data is not None and "exit_code" in data:
            start_error = str(data.get("start_error", ""))
            code = int(data["exit_code"])
            if not oom_verdict(kills, code):  # no OOM kill, or a child's and the command ok
                reason, note = "", ""
            if not note and code == -signal.SIGKILL and h.term_sent_at and h.kill_sent_at:
                note = f"killed with SIGKILL after {rec.stop_grace_s:g} s grace"
            return ExitInfo(
                exit_code=code,
                finished_at_s=float(data.get("finished_at_s") or _mtime(h.exit_file)),
                never_started=bool(start_error),
                message=start_error or note,
                reason="" if start_error else reason,
            )
        if rebooted:
            message = "the node rebooted while it ran; exit status lost"
        elif note:
            message = note
        elif h.kill_sent_at is not None and h.term_sent_at is not None:
            message = f"killed with SIGKILL after {rec.stop_grace_s:g} s grace"
        else:
            message = "exit status lost (the shim was killed); assuming SIGKILL"
        return ExitInfo(
            exit_code=-signal.SIGKILL, finished_at_s=time.time(), message=message, reason=reason
        )


def _last_line(log: Path) -> str:
    """``": <the log's last non-empty line>"`` (at most 300 characters), "" when none."""
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return f": {lines[-1][:300]}" if lines else ""


def _what(h: ProcessHandle) -> str:
    if h.cgroup is not None:
        return f"cgroup {h.cgroup.dirs.get('memory') or h.cgroup.dirs.get('unified')}"
    return f"group {h.pgid}"


def _read_claim(path: Path, wait_s: float = 2.0) -> dict[str, Any] | None:
    """The shim's claim. The shim creates it (``O_EXCL``) and fills it with one ``write``
    right after, so a claim found empty is one being written: re-read it for up to
    ``wait_s`` seconds. None if there is no claim (or it stays unreadable)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if isinstance(data, dict) or time.monotonic() >= deadline:
            return data if isinstance(data, dict) else None
        time.sleep(0.01)


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


def _mtime(path: Path) -> float:
    """When the shim wrote ``path`` (its exit file carries no time of its own)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
