"""Preparing attempts and handing them to a runtime (:mod:`gpufleet.agent.runtime`).

The runner does what is the same for every runtime: the per-attempt directories (state files
under the agent's 0700 state dir; the job-visible work/checkpoint/artifact/resume dirs under
the jobs dir, mode 0700 and owned by the attempt's user), the resume download, the job's user
(:mod:`gpufleet.agent.runtime.jobuser`) and its allow-listed environment
(:func:`gpufleet.agent.workdir.build_env`). Then the runtime chosen for the job (``process`` or
``container``) starts, adopts, watches and stops it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.agent import checkpoint_signal
from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.mounts import attempt_shm_mb, checked_mounts
from gpufleet.agent.runtime import ExitInfo, Launch, RunHandle, Runtime, Runtimes
from gpufleet.agent.runtime.containment import Containment
from gpufleet.agent.runtime.jobuser import JobUsers
from gpufleet.agent.runtime.process import ProcessRuntime
from gpufleet.agent.scratch import DISK_FULL, ScratchDisks, is_full
from gpufleet.agent.workdir import RunPaths, StartError, build_env, download_prefix
from gpufleet.objectstore import ObjectStore

logger = logging.getLogger("gpufleet.agent")

JOBS_ROOT = Path("/var/lib/gpufleet/jobs")

__all__ = ["ExitInfo", "RunHandle", "Runner", "agent_scope", "default_jobs_dir"]


def agent_scope(state_dir: Path, node_id: str) -> str:
    """``{node_id}-{hash of state_dir}``: names this agent's jobs dir and cgroups; stable
    across restarts on the same state dir, distinct for two agents on one host."""
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]
    return f"{node_id}-{digest}"


def default_jobs_dir(state_dir: Path, node_id: str, users: JobUsers) -> Path:
    """Where job-visible attempt dirs go. With user switching: outside the 0700 state dir, in
    ``/var/lib/gpufleet/jobs/{agent_scope}``; without: ``{state_dir}/runs`` (everything runs
    as the agent's user anyway)."""
    if not users.switch:
        return state_dir / "runs"
    return JOBS_ROOT / agent_scope(state_dir, node_id)


LOCAL_RUNS_KEPT = 20
"""Reported attempts whose local log directory is kept (see Runner.cleanup)."""
KEPT_RUNS_FRACTION = 0.02
KEPT_RUNS_MAX_MB = 1024
"""The default byte bound of the kept directories (``--kept-runs-mb``): 2% of the state
dir's filesystem, at most 1 GiB."""
CLEANED_MARK = ".cleaned"
_MIB = 1024 * 1024


def default_kept_runs_mb(path: Path) -> int:
    """:data:`KEPT_RUNS_FRACTION` of the filesystem holding ``path``, at most
    :data:`KEPT_RUNS_MAX_MB`, MiB (0 when it cannot be read)."""
    try:
        total = shutil.disk_usage(path).total
    except OSError:
        return 0
    return min(KEPT_RUNS_MAX_MB, int(total * KEPT_RUNS_FRACTION) // _MIB)


class Runner:
    """Attempts under ``{state_dir}/runs/`` (agent-only files) and ``jobs_dir`` (job files).

    Args:
        state_dir: the agent's state directory (made mode 0700).
        store: where resume checkpoints are downloaded from.
        runtimes: the node's runtimes; default: the process runtime without containment.
        users: who jobs run as; default: the agent's own user (tests of the agent logic).
        jobs_dir: root of the job-visible dirs; default: ``{state_dir}/runs``.
        scratch: per-attempt scratch filesystems (:mod:`gpufleet.agent.scratch`); None or
            disabled: the job dirs are plain directories of the jobs dir's filesystem.
        pids_max: ``pids.max`` of an attempt whose job set no ``pids_limit``; 0 = none.
        allow_mounts: host paths (real, absolute) container jobs may mount, with what is
            under them (``--allow-mount``; ``agent.mounts``); empty = none.
        kept_runs_mb: bound (MiB) on the bytes of the kept directories of reported attempts
            (their logs, see :meth:`cleanup`); None = :func:`default_kept_runs_mb`; 0 =
            keep none.

    Raises:
        ValueError: jobs run as other users (``users.switch``) and cannot reach ``jobs_dir``
            (an ancestor is not searchable by others).
    """

    def __init__(
        self,
        state_dir: Path,
        store: ObjectStore,
        *,
        runtimes: Runtimes | None = None,
        users: JobUsers | None = None,
        jobs_dir: Path | None = None,
        scratch: ScratchDisks | None = None,
        pids_max: int = 0,
        kept_runs_mb: int | None = None,
        allow_mounts: tuple[str, ...] = (),
    ) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o700)
        self.runs_dir = state_dir / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.runs_dir, 0o700)
        self.store = store
        self.runtimes = runtimes or Runtimes(ProcessRuntime(Containment("none", {})))
        self.users = users or JobUsers("", os.getuid(), os.getgid(), False, switch=False)
        self.jobs_dir = jobs_dir or self.runs_dir
        if self.jobs_dir != self.runs_dir:
            self.jobs_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.jobs_dir, 0o711)  # jobs may pass through, not list other attempts
            if self.users.switch:  # (jobs run as other users: they must reach their dirs)
                _check_searchable(self.jobs_dir)
        self.scratch = scratch if scratch is not None and scratch.enabled else None
        # kept even when disabled: mounts made by an earlier agent are still removed
        self.scratch_disks = scratch
        self.pids_max = pids_max
        self.allow_mounts = allow_mounts
        if kept_runs_mb is None:
            kept_runs_mb = default_kept_runs_mb(self.runs_dir)
        self.kept_runs_mb = kept_runs_mb
        self._lock = threading.Lock()
        self._uids: dict[str, int] = {}  # run_id -> job uid, for attempts this agent started
        self._live: dict[str, RunRecord] = {}
        self._spawn_s: dict[str, float] = {}  # run_id -> seconds spawn() took (start phase)

    def paths(self, run_id: str) -> RunPaths:
        job_root = None if self.jobs_dir == self.runs_dir else self.jobs_dir / run_id
        return RunPaths(self.runs_dir / run_id, job_root)

    # ------------------------------------------------------------------ start

    def spawn(self, rec: RunRecord) -> RunHandle:
        """Prepare the attempt and start it with its runtime.

        Call only after the ``assigned`` event is durable, and at most once per run_id.

        Raises:
            StartError: the attempt could not be started (empty command, no container
                runtime for an image, resume download failed, working_dir not a directory or
                not enterable by the job user, command not found, ...). Nothing of it runs.
        """
        t0 = time.monotonic()
        if not rec.command:
            raise StartError("empty command")
        if rec.mounts and not rec.image:
            raise StartError("mounts: a process job has no mounts (they are for containers)")
        mounts = checked_mounts(rec.mounts, self.allow_mounts) if rec.mounts else ()
        runtime = self.runtimes.for_job(rec)
        paths = self.paths(rec.run_id)
        paths.root.mkdir(parents=True, exist_ok=True)
        os.chmod(paths.root, 0o700)
        with self._lock:
            taken = set(self._uids.values()) | {
                int(r.runtime_state["job_uid"])
                for r in self._live.values()
                if "job_uid" in r.runtime_state
            }
            user = self.users.for_run(rec.run_id, home=str(paths.work), taken=taken)
            self._uids[rec.run_id] = user.uid
        try:
            self._make_job_dirs(paths, user.uid, user.gid, user.switch, disk_mb=rec.disk_mb)
            resume_dir: Path | None = None
            if rec.resume_from_uri:
                paths.resume.mkdir(parents=True, exist_ok=True)
                if download_prefix(self.store, rec.resume_from_uri, paths.resume) > 0:
                    resume_dir = paths.resume
                else:
                    logger.warning(
                        "run %s: nothing to resume at %s", rec.run_id, rec.resume_from_uri
                    )
                if user.switch:
                    _chown_tree(paths.resume, user.uid, user.gid)
            # handed to the runtime in memory (the process shim gets it as its environment):
            # the command's secrets are never written to the node's disk by the agent
            env = build_env(rec, paths, resume_dir, home=user.home, agent_env=os.environ)
            cwd = paths.work
            if rec.working_dir and not rec.image:  # an image's working_dir is inside it
                cwd = Path(rec.working_dir)
                if not cwd.is_absolute() or not cwd.is_dir():
                    raise StartError(
                        f"working_dir {rec.working_dir!r} is not a directory on this node"
                    )
            launch = Launch(
                paths=paths,
                command=tuple(rec.command),
                env=env,
                cwd=cwd,
                user=user,
                memory_mb=rec.memory_mb,
                cpu=rec.cpu,
                gpu_ids=tuple(rec.gpu_ids),
                resume_dir=resume_dir,
                pids_max=rec.pids_limit if rec.pids_limit > 0 else self.pids_max,
                mounts=mounts,
                shm_mb=attempt_shm_mb(rec.shm_size_mb, rec.memory_mb),
            )
            h = runtime.spawn(rec, launch)
            with self._lock:
                self._spawn_s[rec.run_id] = time.monotonic() - t0
            return h
        except BaseException:
            with self._lock:
                self._uids.pop(rec.run_id, None)
            if self.scratch is not None:
                self.scratch.remove(rec.run_id, paths.job_root)
            raise

    def started_fields(self, rec: RunRecord, h: RunHandle) -> dict[str, Any]:
        """The ``started`` event's fields for ``h`` (runtime, its state, the job's uid, and
        ``start_phases``: ``runtime`` plus ``start_s`` for a process, or the container
        runtime's ``image`` warm/cold, ``pull_s``, ``create_s``, ``start_s``; seconds)."""
        fields = h.log_fields()
        state = dict(fields.get("runtime_state") or {})
        kind = type(h).runtime or "process"
        with self._lock:
            if rec.run_id in self._uids:
                state["job_uid"] = self._uids[rec.run_id]
            self._live[rec.run_id] = rec
            spawn_s = self._spawn_s.pop(rec.run_id, None)
        fields["runtime_state"] = state
        fields["runtime"] = kind
        phases = dict(getattr(h, "phases", None) or {})
        if phases:
            fields["start_phases"] = {"runtime": kind, **phases}
        elif spawn_s is not None:  # not for an attempt adopted after a restart
            fields["start_phases"] = {"runtime": kind, "start_s": round(spawn_s, 4)}
        return fields

    def resolve_unstarted(self, rec: RunRecord) -> RunHandle | None:
        """After a restart, settle an attempt logged ``assigned`` but never ``started``.

        Returns:
            The handle if the start had gone through (adopt it), or None if the start is now
            abandoned for good (report NEVER_STARTED).
        """
        try:
            runtime = self.runtimes.for_job(rec)
        except StartError:
            return None
        return runtime.resolve_unstarted(rec, self.paths(rec.run_id))

    def adopt(self, rec: RunRecord) -> RunHandle:
        """A handle for a logged, started attempt this agent process did not spawn.

        Raises:
            StartError: its runtime is not available on this agent.
        """
        with self._lock:
            self._live[rec.run_id] = rec
        return self.runtimes.for_record(rec).adopt(rec, self.paths(rec.run_id))

    # ------------------------------------------------------------------ watch and stop

    def poll(self, rec: RunRecord, h: RunHandle, now: float) -> ExitInfo | None:
        """One monitoring step of the attempt's runtime (see :mod:`.runtime.base`), with the
        checkpoint handshake of a stop (:mod:`.checkpoint_signal`) around it."""
        done = self.paths(rec.run_id).checkpoint_done
        checkpoint_signal.before_poll(rec, h, done)
        info = self._runtime_of(h).poll(rec, h, now)
        if info is None:
            checkpoint_signal.after_poll(rec, h, done, now)
            return None
        with self._lock:
            self._live.pop(rec.run_id, None)
        info = self._disk_full(rec, info)
        handshake = checkpoint_signal.summary(rec, h)
        if handshake:
            message = info.message
            if (
                handshake["signalled"]
                and handshake.get("saved_s", 0.0) > 0
                and (not message or message.startswith("killed with SIGKILL after"))
            ):
                message = (
                    f"stopped {handshake['signal_after_s']:g} s after SIGTERM on its checkpoint"
                    f" signal ({handshake['saved_s']:g} s of {rec.stop_grace_s:g} s grace saved)"
                )
            info = replace(info, stop_handshake=handshake, message=message)
        return info

    def _disk_full(self, rec: RunRecord, info: ExitInfo) -> ExitInfo:
        """``info`` with reason DISK_FULL when the command failed with its scratch
        filesystem full (the likely cause: its writes got ENOSPC)."""
        root = self.paths(rec.run_id).job_root
        if (
            self.scratch is None
            or root is None
            or info.exit_code == 0
            or info.reason
            or info.never_started
            or not os.path.ismount(root)
            or not is_full(root)
        ):
            return info
        size = self.scratch.size_of(rec.run_id) or self.scratch.size_mb(rec.disk_mb)
        note = (
            f"DISK_FULL: the attempt filled its scratch filesystem (disk_mb={size}: work, "
            "checkpoints, artifacts, /tmp) and its command failed"
        )
        if info.message:
            note = f"{note}; {info.message}"
        return replace(info, reason=DISK_FULL, message=note)

    def _runtime_of(self, h: RunHandle) -> Runtime:
        if type(h).runtime == "container" and self.runtimes.container is not None:
            return self.runtimes.container
        return self.runtimes.process

    def cleanup(self, rec: RunRecord) -> None:
        """Once its completion was answered: release the runtime's resources (cgroup,
        container) and remove the attempt's bulky local files (its log and artifacts are
        uploaded by then). The log, exit file and claim stay for local debugging, for the
        most recently cleaned attempts only: at most ``LOCAL_RUNS_KEPT`` of them, and at most
        ``kept_runs_mb`` MiB together; older attempt directories (and one alone over the
        bound: a noisy job's log) are removed whole (a bounded cache, so the disk cannot fill
        up with old logs). Under disk pressure :meth:`relieve` removes them first."""
        with contextlib.suppress(StartError):
            self.runtimes.for_record(rec).release(rec)
        paths = self.paths(rec.run_id)
        if self.scratch_disks is not None:  # unmount, delete its filesystem (what is left: empty)
            self.scratch_disks.remove(rec.run_id, paths.job_root)
        for d in (paths.work, paths.checkpoints, paths.artifacts, paths.resume, paths.tmp):
            shutil.rmtree(d, ignore_errors=True)
        if paths.job_root is not None:
            with contextlib.suppress(OSError):
                paths.job_root.rmdir()
        with self._lock:
            self._uids.pop(rec.run_id, None)
            self._live.pop(rec.run_id, None)
        try:
            (paths.root / CLEANED_MARK).touch()
        except OSError:  # no room even for the mark (a full disk): nothing of it is kept
            shutil.rmtree(paths.root, ignore_errors=True)
        kept, total = 0, 0
        for _, d, size in reversed(self.kept_runs()):  # newest first, while they fit
            if kept < LOCAL_RUNS_KEPT and total + size <= self.kept_runs_mb * _MIB:
                kept, total = kept + 1, total + size
            else:
                shutil.rmtree(d, ignore_errors=True)

    def kept_runs(self) -> list[tuple[float, Path, int]]:
        """``(cleaned at, directory, bytes)`` of the kept directories of reported attempts,
        oldest first."""
        out = []
        for mark in self.runs_dir.glob(f"*/{CLEANED_MARK}"):
            try:
                out.append((mark.stat().st_mtime, mark.parent, _tree_bytes(mark.parent)))
            except OSError:  # removed meanwhile
                continue
        return sorted(out)

    def relieve(self, min_free_mb: int) -> tuple[int, int]:
        """Disk pressure: remove kept directories of reported attempts, oldest first, until
        the runs dir's filesystem has ``min_free_mb`` MiB free or none is left. They are the
        first thing freed: their logs are in the object store already. Cheap when there is
        no pressure (one ``statvfs``).

        Returns:
            ``(directories removed, MiB freed)``.
        """
        removed, freed = 0, 0
        if _free_mb(self.runs_dir) >= min_free_mb:
            return 0, 0
        for _, d, size in self.kept_runs():
            shutil.rmtree(d, ignore_errors=True)
            removed, freed = removed + 1, freed + size
            if _free_mb(self.runs_dir) >= min_free_mb:
                break
        if removed:
            logger.warning(
                "disk pressure: removed %d kept attempt dir(s) (%.1f MiB of old logs) in %s",
                removed,
                freed / _MIB,
                self.runs_dir,
            )
        return removed, freed // _MIB

    def disk_free_mb(self) -> dict[str, int]:
        """Free space of the state and scratch directories, MiB, by path."""
        out: dict[str, int] = {}
        for d in {self.runs_dir.parent, self.runs_dir, self.jobs_dir}:
            try:
                out[str(d)] = shutil.disk_usage(d).free // (1024 * 1024)
            except OSError:
                out[str(d)] = 0
        return out

    def live_uids(self) -> dict[str, int]:
        """run_id -> job uid of the attempts this agent runs (for tests and diagnostics)."""
        with self._lock:
            return dict(self._uids)

    # ------------------------------------------------------------------ helpers

    def _make_job_dirs(
        self, paths: RunPaths, uid: int, gid: int, switch: bool, *, disk_mb: int = 0
    ) -> None:
        """The job-visible dirs, 0700 and the job's; with a scratch filesystem its root is
        ``paths.job_root`` (mounted first). ``tmp`` (the job's /tmp) is 01777 like /tmp.

        Raises:
            StartError: the scratch filesystem cannot be made (see ScratchDisks.create).
        """
        dirs = [paths.work, paths.checkpoints, paths.artifacts]
        if paths.job_root is not None:
            dirs.insert(0, paths.job_root)
            if self.scratch is not None:
                paths.job_root.mkdir(parents=True, exist_ok=True)
                size = self.scratch.size_mb(disk_mb)
                self.scratch.create(
                    paths.job_root.name, paths.job_root, size, uid, gid, shrink_to_fit=disk_mb <= 0
                )
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            if switch:
                os.chown(d, uid, gid, follow_symlinks=False)
            os.chmod(d, 0o700)
        paths.tmp.mkdir(exist_ok=True)
        os.chmod(paths.tmp, 0o1777)

    def scratch_keep(self, run_ids: set[str]) -> set[str]:
        """Of ``run_ids`` (the attempts in the assignment log), those whose scratch must
        stay: not cleaned yet (running, or outputs not uploaded and reported)."""
        return {r for r in run_ids if not (self.runs_dir / r / CLEANED_MARK).exists()}


def _free_mb(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free // _MIB
    except OSError:
        return 0


def _tree_bytes(root: Path) -> int:
    """Bytes the files under ``root`` occupy (allocated blocks: what removing them frees)."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """chown a tree the agent just wrote (no symlinks followed)."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        os.chown(dirpath, uid, gid, follow_symlinks=False)
        for name in (*dirnames, *filenames):
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


def _check_searchable(path: Path) -> None:
    """Raise ValueError when another user cannot traverse an ancestor of ``path``."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            raise ValueError(
                f"jobs dir {path}: {parent} is not searchable by other users (mode "
                f"{stat.filemode(mode)}), so job users could not reach their directories; "
                "choose another --jobs-dir"
            )
