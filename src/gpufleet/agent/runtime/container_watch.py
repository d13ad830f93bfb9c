"""A started container attempt: its handle, and watching it until it ends (stop included).

:class:`ContainerHandle` is the live attempt (its fields are logged with the ``started`` event
and come back after an agent restart). :func:`poll_container` is one monitoring step of
:meth:`.ContainerRuntime.poll`:

* the end is seen when the log follower exits (cheap), or by ``inspect`` at most every
  :data:`INSPECT_EVERY_S` seconds while a follower runs (every :data:`INSPECT_NO_FOLLOWER_S`
  without one, every :data:`INSPECT_STOPPING_S` while stopping; each ``inspect`` costs tens of
  ms of CPU);
* **the engine is not believed alone.** A podman container whose ``conmon`` died stays
  "running" in podman for good (nothing is left to record its exit). With the attempt's cgroup
  (:attr:`ContainerHandle.cgroup`, the container's ``--cgroup-parent``: ``conmon/`` and
  ``libpod-<id>/`` are below it) the agent looks itself: when the engine says running (or does
  not answer) but conmon is dead and the group holds no process, the attempt has ended with
  its exit status lost and its processes verified gone (:data:`LOST_EXIT`);
* **OOM** is :func:`.containment.oom_verdict` (the rule of the process runtime): the kernel's
  OOM-kill counter of the container's group (read from the group, or from the copy the OCI
  runtime wrapper saved before ``runc delete`` removed it:
  :meth:`.ContainerEngine.keep_oom_counters`) above zero and an exit code other than 0.
  Neither exit 137 nor a memory peak at the limit (page cache) is an OOM. Without a cgroup
  (a rootless engine) the engine's ``State.OOMKilled`` is used;
* stop (seed DD5): ``kill --signal TERM``, ``rec.stop_grace_s`` seconds of grace (ended early
  by the job's checkpoint signal, :func:`.base.grace_over`),
  ``kill --signal KILL`` (re-sent every second); while processes of the container are left
  after that (or when the engine fails or gives no answer to a kill), they are killed through
  the cgroup (frozen, SIGKILL, thawed; conmon is spared so it can still record the exit).
  *Verified gone* = the engine says the container is not running, or conmon is dead and the
  cgroup is empty; then its exit is saved to ``exit.json`` and it is removed (``rm --force
  --time 0``, retried, and its cgroup) before the attempt is reported, so its GPUs are
  released only after that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gpufleet.agent import procfs
from gpufleet.agent.runtime.base import (
    KILL_RESEND_S,
    KILL_VERIFY_TIMEOUT_S,
    OOM_KILLED,
    ExitInfo,
    RunHandle,
    grace_over,
)
from gpufleet.agent.runtime.container_engine import ContainerEngine, ContainerState, EngineError
from gpufleet.agent.runtime.containment import (
    JobCgroup,
    oom_kills,
    oom_verdict,
    remove_engine_parent,
)
from gpufleet.agent.workdir import RunPaths

logger = logging.getLogger("gpufleet.agent")

INSPECT_EVERY_S = 10.0
INSPECT_NO_FOLLOWER_S = 1.0
INSPECT_STOPPING_S = 0.2
LOG_DRAIN_TIMEOUT_S = 5.0
LOST_DRAIN_TIMEOUT_S = 1.0
"""Log drain when conmon died (the follower may never see the container end)."""
OOM_USAGE_FRACTION = 0.98
"""Kept for callers of the earlier heuristic; a memory peak no longer decides an OOM."""
LOST_EXIT = (
    "the container's monitor (conmon) died: exit status lost; its processes are verified"
    " gone (its cgroup is empty)"
)
"""``ExitInfo.message`` of a container that ended after its conmon died."""


@dataclass(slots=True, kw_only=True)
class ContainerHandle(RunHandle):
    """A live container attempt (the stop progress fields are :class:`RunHandle`'s).

    ``phases``: start phases in seconds (``pull_s``, ``create_s``, ``start_s``) and ``image``
    (``warm``/``cold``); empty for an adopted attempt. ``pid`` is the container's init as
    the host sees it. ``cgroup``: the container's ``--cgroup-parent`` group
    (``cgroup_parent``, its path from the hierarchy root), None without cgroups;
    ``conmon_pid``/``conmon_start_ticks``: podman's monitor (0 = unknown); ``oom_dir``: where
    the OCI runtime wrapper saves OOM counters (None = not wrapped).
    """

    runtime: ClassVar[str] = "container"
    name: str
    container_id: str = ""
    phases: dict[str, Any] = field(default_factory=dict)
    memory_mb: int = 0
    paths: RunPaths | None = None
    logs: subprocess.Popen[bytes] | None = None
    logs_pid: int = 0
    logs_start_ticks: int = 0
    next_inspect_at: float = 0.0
    follower_done: bool = False
    cgroup: JobCgroup | None = None
    cgroup_parent: str = ""
    conmon_pid: int = 0
    conmon_start_ticks: int = 0
    oom_dir: Path | None = None

    def log_fields(self) -> dict[str, Any]:
        """JSON fields for the ``started`` event of the assignment log."""
        return {
            "pid": self.pid,
            "boot_id": self.boot_id,
            "runtime_state": {
                "runtime": "container",
                "name": self.name,
                "container_id": self.container_id,
                "logs_pid": self.logs_pid,
                "logs_start_ticks": self.logs_start_ticks,
                "phases": self.phases,
                "memory_mb": self.memory_mb,
                "cgroup": self.cgroup.to_json() if self.cgroup is not None else None,
                "cgroup_parent": self.cgroup_parent,
                "conmon_pid": self.conmon_pid,
                "conmon_start_ticks": self.conmon_start_ticks,
            },
        }


def poll_container(
    engine: ContainerEngine, rec: Any, h: ContainerHandle, now: float, paths: RunPaths
) -> ExitInfo | None:
    """One monitoring step of the container attempt ``h`` (see the module doc).

    ``rec`` needs ``run_id``, ``stop_requested``, ``stop_reason``, ``stop_grace_s``.

    Returns:
        How it ended, once the container is verified not running and removed; else None.
    """
    if rec.stop_requested and h.term_sent_at is None:
        logger.info("run %s: SIGTERM to container %s (%s)", rec.run_id, h.name, rec.stop_reason)
        if not engine.kill(h.name, "TERM") and h.cgroup is not None:
            h.cgroup.signal_all(signal.SIGTERM, exclude=_monitor_pids(h))
        h.term_sent_at = now
        h.next_inspect_at = 0.0
    if h.kill_sent_at is None and grace_over(rec, h, now):
        if h.checkpoint_done_at is not None:
            logger.info("run %s: checkpoint signalled: SIGKILL the container", rec.run_id)
        else:
            logger.warning(
                "run %s: container alive after %g s grace: SIGKILL", rec.run_id, rec.stop_grace_s
            )
        if not engine.kill(h.name, "KILL"):
            _kill_cgroup(rec, h, "the engine did not kill it")
        h.kill_sent_at = h.kill_resent_at = now
        h.next_inspect_at = 0.0
    if not h.follower_done and _follower_done(h):
        h.follower_done = True  # the container has most likely ended: look now
        h.next_inspect_at = 0.0
    if now < h.next_inspect_at and h.conmon_pid and _gone_without_engine(h):
        h.next_inspect_at = 0.0  # conmon and the processes are gone (cheap: /proc, cgroup)
    if now < h.next_inspect_at:
        return None
    if h.term_sent_at is not None:
        every = INSPECT_STOPPING_S
    elif h.follower_done or (h.logs is None and not h.logs_pid):
        every = INSPECT_NO_FOLLOWER_S
    else:
        every = INSPECT_EVERY_S
    h.next_inspect_at = now + every
    st, engine_ok = _inspect(engine, h)
    lost = False
    if _running(st, engine_ok):
        # the engine says running (or cannot say): believe it only while the container's
        # processes or its monitor are alive
        if not _gone_without_engine(h):
            _stop_progress(engine, rec, h, now)
            return None
        st, engine_ok = _inspect(engine, h)  # a normal end completing right now?
        lost = _running(st, engine_ok)
    if _container_pids(h):
        # the engine calls it ended (podman: "stopped" after a failed kill) while processes
        # of it are left: not verified gone; they go through the cgroup, looked at again soon
        if h.kill_sent_at is None:
            h.kill_sent_at = now
        h.kill_resent_at = now
        _kill_cgroup(rec, h, f"{engine.kind} says it ended but processes are left")
        h.next_inspect_at = now + INSPECT_STOPPING_S
        return None
    h.main_exited = True
    if lost:
        logger.error("run %s: container %s: %s", rec.run_id, h.name, LOST_EXIT)
    _drain_logs(h, LOST_DRAIN_TIMEOUT_S if lost or (st and st.exit_code < 0) else None)
    info = _exit_info(rec, h, st, paths, lost=lost)
    if st is not None or lost:
        engine.remove(h.name)
    _remove_groups(h)
    h.unkillable = False
    return info


def _stop_progress(engine: ContainerEngine, rec: Any, h: ContainerHandle, now: float) -> None:
    """A stopped container still runs: re-send SIGKILL every :data:`KILL_RESEND_S` (through
    the cgroup while processes are left or the engine fails), and mark it unkillable after
    :data:`KILL_VERIFY_TIMEOUT_S`."""
    if h.kill_sent_at is None:
        return
    if now - (h.kill_resent_at or now) >= KILL_RESEND_S:
        if not engine.kill(h.name, "KILL") or _container_pids(h):
            _kill_cgroup(rec, h, "processes left after SIGKILL")
        h.kill_resent_at = now
    if now - h.kill_sent_at >= KILL_VERIFY_TIMEOUT_S and not h.unkillable:
        h.unkillable = True
        logger.error("run %s: container survives SIGKILL", rec.run_id)


def _running(st: ContainerState | None, engine_ok: bool) -> bool:
    """The engine says the container runs, or cannot say."""
    return st.running if st is not None else not engine_ok


def _inspect(engine: ContainerEngine, h: ContainerHandle) -> tuple[ContainerState | None, bool]:
    """``inspect``, and whether the engine answered (an engine that fails or hangs is
    judged by the cgroup)."""
    try:
        return engine.inspect(h.name), True
    except EngineError as exc:
        logger.warning("run %s: %s inspect failed: %s", h.name, engine.kind, exc)
        return None, False


def _conmon(h: ContainerHandle) -> frozenset[int]:
    """conmon's pid while it is alive (spared by cgroup kills: it records the exit)."""
    if h.conmon_pid and procfs.is_same_process_alive(h.conmon_pid, h.conmon_start_ticks):
        return frozenset({h.conmon_pid})
    return frozenset()


def _monitor_pids(h: ContainerHandle) -> frozenset[int]:
    """conmon and what it runs (podman's ``container cleanup``): the ``conmon/`` sub-group
    podman makes under the container's parent, and conmon's own pid. Spared by cgroup kills."""
    if h.cgroup is None:
        return _conmon(h)
    monitor = JobCgroup(h.cgroup.kind, {c: d / "conmon" for c, d in h.cgroup.dirs.items()})
    return frozenset(monitor.pids()) | _conmon(h)


def _container_pids(h: ContainerHandle) -> set[int]:
    """The container's own processes (the cgroup's but conmon's); empty without a cgroup."""
    return h.cgroup.pids() - _monitor_pids(h) if h.cgroup is not None else set()


def _kill_cgroup(rec: Any, h: ContainerHandle, why: str) -> None:
    if h.cgroup is None or not _container_pids(h):
        return
    logger.warning("run %s: SIGKILL through the container's cgroup (%s)", rec.run_id, why)
    try:
        h.cgroup.kill_all(exclude=_monitor_pids(h))
    except OSError as exc:
        logger.error("run %s: cgroup kill failed: %s", rec.run_id, exc)


def _gone_without_engine(h: ContainerHandle) -> bool:
    """conmon is dead and no process of the container is left (its cgroup is empty; without
    a cgroup: its init is gone). False when that cannot be known (no cgroup and no pids)."""
    if h.conmon_pid == 0 and h.cgroup is None:
        return False
    if _conmon(h):
        return False
    if h.cgroup is not None:
        return h.cgroup.exists() and not h.cgroup.pids()
    return h.pid > 0 and procfs.read_stat(h.pid) is None


def _remove_groups(h: ContainerHandle) -> None:
    if h.cgroup_parent:
        remove_engine_parent(h.cgroup_parent)
    remove_cgroup(h.name)
    if h.oom_dir is not None and h.container_id:
        with contextlib.suppress(OSError):
            (h.oom_dir / h.container_id).unlink()


def _follower_done(h: ContainerHandle) -> bool:
    if h.logs is not None:
        return h.logs.poll() is not None
    if h.logs_pid:
        return not procfs.is_same_process_alive(h.logs_pid, h.logs_start_ticks)
    return False


def _drain_logs(h: ContainerHandle, timeout_s: float | None = None) -> None:
    """Let the follower write the last lines (it exits once the container has); at most
    ``timeout_s`` (default :data:`LOG_DRAIN_TIMEOUT_S`) seconds."""
    timeout_s = LOG_DRAIN_TIMEOUT_S if timeout_s is None else timeout_s
    if h.logs is not None:
        try:
            h.logs.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            h.logs.kill()
            h.logs.wait()
        return
    deadline = time.monotonic() + timeout_s
    while h.logs_pid and procfs.is_same_process_alive(h.logs_pid, h.logs_start_ticks):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.logs_pid, signal.SIGKILL)
            break
        time.sleep(0.05)


def _exit_info(
    rec: Any, h: ContainerHandle, st: ContainerState | None, paths: RunPaths, *, lost: bool = False
) -> ExitInfo:
    saved = _read_json(paths.exit_file)
    if st is None and not lost and saved is not None and "exit_code" in saved:
        # Removed by an earlier pass that died before its report was logged.
        return ExitInfo(
            int(saved["exit_code"]),
            float(saved.get("finished_at_s", time.time())),
            message=str(saved.get("message", "")),
            reason=str(saved.get("reason", "")),
        )
    if st is None and not lost:
        return ExitInfo(
            -signal.SIGKILL, time.time(), message="the container disappeared; exit status lost"
        )
    if lost or st is None or st.exit_code < 0:  # conmon died: nothing recorded the status
        code, message = -signal.SIGKILL, LOST_EXIT
    else:
        code, message = st.exit_code, ""
    kills = container_oom_kills(h)
    if kills < 0:  # no cgroup to read (a rootless engine): the engine's word
        kills = 1 if st is not None and st.oom_killed else -1
    reason = ""
    if oom_verdict(kills, code):
        reason = OOM_KILLED
        message = "killed by the memory limit (memory_mb)" + (f"; {message}" if message else "")
    elif h.kill_sent_at is not None and h.term_sent_at is not None and code == 137:
        message = f"killed with SIGKILL after {rec.stop_grace_s:g} s grace"
    if reason and code == 128 + signal.SIGKILL:
        code = -signal.SIGKILL
    info = ExitInfo(code, time.time(), message=message, reason=reason)
    with contextlib.suppress(OSError):
        paths.exit_file.write_text(
            json.dumps(
                {
                    "exit_code": info.exit_code,
                    "finished_at_s": info.finished_at_s,
                    "message": info.message,
                    "reason": info.reason,
                }
            )
        )
    return info


def container_oom_kills(h: ContainerHandle) -> int:
    """The kernel's OOM-kill count of the container's processes (-1 = unknown).

    Read after they are gone, race-free against the engine's cleanup: the copy the OCI runtime
    wrapper saved on ``runc delete``, else the container's own ``libpod-<id>`` group (and,
    on v2, the ``--cgroup-parent`` group: its ``memory.events`` counts the subtree), else the
    saved copy again (the wrapper writes it before runc removes the group)."""
    saved = h.oom_dir / h.container_id if h.oom_dir is not None and h.container_id else None
    if saved is not None and saved.is_file():
        return oom_kills(saved)
    if h.cgroup is None:
        return -1
    found = -1
    mem = h.cgroup.dirs.get("memory") or h.cgroup.dirs.get("unified")
    if mem is not None:
        groups = [mem / f"libpod-{h.container_id}"] if h.container_id else []
        with contextlib.suppress(OSError):
            groups += [d for d in mem.glob("libpod-*") if d not in groups]
        if h.cgroup.kind == "cgroup-v2":
            groups.append(mem)
        for g in groups:
            found = max(found, oom_kills(g))
    if found < 0 and saved is not None and saved.is_file():
        return oom_kills(saved)
    return found


def remove_cgroup(name: str) -> None:
    """Remove the cgroup v1 directories the container ran under (``/gpufleet/<run_id>``
    under each controller); missing ones are not an error."""
    for ctl in ("memory", "cpu", "cpuacct", "pids", "blkio", "cpuset", "devices", "freezer"):
        base = Path("/sys/fs/cgroup") / ctl / "gpufleet" / name
        if not base.is_dir():
            continue
        for sub in sorted(base.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
