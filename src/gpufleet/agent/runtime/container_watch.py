"""A started container attempt: its handle, and watching it until it ends (stop included).

:class:`ContainerHandle` is the live attempt (its fields are logged with the ``started`` event
and come back after an agent restart). :func:`poll_container` is one monitoring step of
:meth:`.ContainerRuntime.poll`:

* the end is seen when the log follower exits (cheap), or by ``inspect`` at most every
  :data:`INSPECT_EVERY_S` seconds while a follower runs (every :data:`INSPECT_NO_FOLLOWER_S`
  without one, every :data:`INSPECT_STOPPING_S` while stopping; each ``inspect`` costs tens of
  ms of CPU). Exit code and OOM come from ``inspect`` (``State.OOMKilled``; on cgroup v1 hosts
  where the engine does not report it, exit 137 with the container's memory cgroup having
  reached its limit also counts as OOM);
* stop (seed DD5): ``kill --signal TERM``, ``rec.stop_grace_s`` seconds of grace,
  ``kill --signal KILL`` (re-sent every second), *verified gone* = the engine says the
  container is not running; then its exit is saved to ``exit.json`` and it is removed (``rm``,
  and its cgroup) before the attempt is reported, so its GPUs are released only after that.
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
)
from gpufleet.agent.runtime.container_engine import ContainerEngine, ContainerState
from gpufleet.agent.workdir import RunPaths

logger = logging.getLogger("gpufleet.agent")

INSPECT_EVERY_S = 10.0
INSPECT_NO_FOLLOWER_S = 1.0
INSPECT_STOPPING_S = 0.2
LOG_DRAIN_TIMEOUT_S = 5.0
OOM_USAGE_FRACTION = 0.98


@dataclass(slots=True, kw_only=True)
class ContainerHandle(RunHandle):
    """A live container attempt (the stop progress fields are :class:`RunHandle`'s).

    ``phases``: start phases in seconds (``pull_s``, ``create_s``, ``start_s``) and ``image``
    (``warm``/``cold``); empty for an adopted attempt. ``pid`` is the container's init as
    the host sees it.
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
        engine.kill(h.name, "TERM")
        h.term_sent_at = now
        h.next_inspect_at = 0.0
    if (
        h.kill_sent_at is None
        and h.term_sent_at is not None
        and now - h.term_sent_at >= rec.stop_grace_s
    ):
        logger.warning(
            "run %s: container alive after %g s grace: SIGKILL", rec.run_id, rec.stop_grace_s
        )
        engine.kill(h.name, "KILL")
        h.kill_sent_at = h.kill_resent_at = now
        h.next_inspect_at = 0.0
    if not h.follower_done and _follower_done(h):
        h.follower_done = True  # the container has most likely ended: look now
        h.next_inspect_at = 0.0
    if now < h.next_inspect_at:
        return None
    if h.term_sent_at is not None:
        every = INSPECT_STOPPING_S
    elif h.follower_done or (h.logs is None and not h.logs_pid):
        every = INSPECT_NO_FOLLOWER_S
    else:
        every = INSPECT_EVERY_S
    h.next_inspect_at = now + every
    st = engine.inspect(h.name)
    if st is not None and st.running:
        if h.kill_sent_at is not None:
            if now - (h.kill_resent_at or now) >= KILL_RESEND_S:
                engine.kill(h.name, "KILL")
                h.kill_resent_at = now
            if now - h.kill_sent_at >= KILL_VERIFY_TIMEOUT_S and not h.unkillable:
                h.unkillable = True
                logger.error("run %s: container survives SIGKILL", rec.run_id)
        return None
    h.main_exited = True
    _drain_logs(h)
    info = _exit_info(rec, h, st, paths)
    if st is not None:
        engine.remove(h.name)
    remove_cgroup(h.name)
    h.unkillable = False
    return info


def _follower_done(h: ContainerHandle) -> bool:
    if h.logs is not None:
        return h.logs.poll() is not None
    if h.logs_pid:
        return not procfs.is_same_process_alive(h.logs_pid, h.logs_start_ticks)
    return False


def _drain_logs(h: ContainerHandle) -> None:
    """Let the follower write the last lines (it exits once the container has)."""
    if h.logs is not None:
        try:
            h.logs.wait(timeout=LOG_DRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            h.logs.kill()
            h.logs.wait()
        return
    deadline = time.monotonic() + LOG_DRAIN_TIMEOUT_S
    while h.logs_pid and procfs.is_same_process_alive(h.logs_pid, h.logs_start_ticks):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.logs_pid, signal.SIGKILL)
            break
        time.sleep(0.05)


def _exit_info(
    rec: Any, h: ContainerHandle, st: ContainerState | None, paths: RunPaths
) -> ExitInfo:
    saved = _read_json(paths.exit_file)
    if st is None and saved is not None and "exit_code" in saved:
        # Removed by an earlier pass that died before its report was logged.
        return ExitInfo(
            int(saved["exit_code"]),
            float(saved.get("finished_at_s", time.time())),
            message=str(saved.get("message", "")),
            reason=str(saved.get("reason", "")),
        )
    if st is None:
        return ExitInfo(
            -signal.SIGKILL, time.time(), message="the container disappeared; exit status lost"
        )
    code = st.exit_code
    reason, message = "", ""
    oom = st.oom_killed or (
        code == 128 + signal.SIGKILL
        and h.kill_sent_at is None
        and _cgroup_hit_limit(h.name, h.memory_mb)
    )
    if oom:
        reason, message = OOM_KILLED, "killed by the memory limit (memory_mb)"
    elif h.kill_sent_at is not None and h.term_sent_at is not None and code == 137:
        message = f"killed with SIGKILL after {rec.stop_grace_s:g} s grace"
    if oom:
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


def _cgroup_hit_limit(name: str, memory_mb: int) -> bool:
    """cgroup v1 (podman does not report OOMKilled there): the memory cgroup the agent put
    the container under (``/gpufleet/<run_id>``) peaked at the job's limit."""
    if memory_mb <= 0:
        return False
    try:
        peak = int(
            Path(f"/sys/fs/cgroup/memory/gpufleet/{name}/memory.max_usage_in_bytes").read_text()
        )
    except (OSError, ValueError):
        return False
    return peak >= OOM_USAGE_FRACTION * (memory_mb << 20)


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
