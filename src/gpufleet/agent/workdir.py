"""The directory and environment of one attempt.

Job-visible directories, in ``{jobs_dir}/{run_id}/`` (mode 0700, owned by the attempt's user;
``jobs_dir`` is 0711, so a job can reach its own directory but not list or enter another's)
or in ``{state_dir}/runs/{run_id}/`` when the agent cannot switch users::

    work/          the command's working directory and HOME; holds the entry named by
                   GPUFLEET_CHECKPOINT_DONE (:mod:`gpufleet.agent.checkpoint_signal`)
    checkpoints/   GPUFLEET_CHECKPOINT_DIR (empty at start; uploaded at exit)
    artifacts/     GPUFLEET_ARTIFACTS_DIR (uploaded at exit)
    resume/        GPUFLEET_RESUME_FROM (objects under resume_from_uri, downloaded before start)
    tmp/           the job's /tmp and /var/tmp (bound there in its own mount namespace)

With a scratch filesystem (:mod:`gpufleet.agent.scratch`) ``{jobs_dir}/{run_id}/`` is the
root of the attempt's own loop-mounted filesystem, so all of the above share its size.

Agent-only files, in ``{state_dir}/runs/{run_id}/`` (the state dir is 0700)::

    output.log     stdout + stderr of the command (streamed to the object store)
    shim.json      the shim's claim: pid, pgid, start_ticks, boot_id (or the agent's
                   "abandoned" mark)
    exit.json      the shim's record of the exit code (empty while the command runs)
    shim.log       the shim's own stderr
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufleet.agent.assignment_log import RunRecord
from gpufleet.domain.interactive import ACTIVITY_ENV, ACTIVITY_NAME
from gpufleet.objectstore import ObjectStore


class StartError(Exception):
    """The attempt could not be started; it is reported NEVER_STARTED with this message.

    ``node_fault``: the node caused it (its disk, the shim, the runtime), not the job's spec;
    the controller then charges the node and re-places the job without using a retry."""

    def __init__(self, message: str, *, node_fault: bool = False) -> None:
        super().__init__(message)
        self.node_fault = node_fault


CHECKPOINT_DONE_NAME = ".gpufleet-checkpoint-done"
"""The checkpoint handshake's file, in the attempt's work directory."""


@dataclass(frozen=True, slots=True)
class RunPaths:
    """The on-disk layout of one attempt (see module doc).

    Attributes:
        root: the agent-only directory (log, claim, exit and env files).
        job_root: the job-visible directory; None = the same as ``root``.
    """

    root: Path
    job_root: Path | None = None

    @property
    def _jobs(self) -> Path:
        return self.job_root if self.job_root is not None else self.root

    @property
    def work(self) -> Path:
        return self._jobs / "work"

    @property
    def checkpoint_done(self) -> Path:
        """``$GPUFLEET_CHECKPOINT_DONE``: the job creates it once its checkpoint after a
        SIGTERM is durable (:mod:`gpufleet.agent.checkpoint_signal`)."""
        return self.work / CHECKPOINT_DONE_NAME

    @property
    def exec_activity(self) -> Path:
        """``$GPUFLEET_EXEC_ACTIVITY``: the agent's record of exec sessions into the attempt
        (:mod:`gpufleet.domain.interactive`)."""
        return self.work / ACTIVITY_NAME

    @property
    def checkpoints(self) -> Path:
        return self._jobs / "checkpoints"

    @property
    def artifacts(self) -> Path:
        return self._jobs / "artifacts"

    @property
    def resume(self) -> Path:
        return self._jobs / "resume"

    @property
    def tmp(self) -> Path:
        """The attempt's private ``/tmp`` (and ``/var/tmp``), bound there in its mount
        namespace."""
        return self._jobs / "tmp"

    @property
    def log(self) -> Path:
        return self.root / "output.log"

    @property
    def claim(self) -> Path:
        return self.root / "shim.json"

    @property
    def exit_file(self) -> Path:
        return self.root / "exit.json"

    @property
    def env_file(self) -> Path:
        return self.root / "env.json"

    @property
    def shim_log(self) -> Path:
        return self.root / "shim.log"


# Taken from the agent's environment only when the job does not set them: harmless locale and
# terminal settings. Nothing else of the agent's environment reaches a job (it may hold the
# agent's configuration, tokens or credentials).
AGENT_ENV_ALLOWED = ("LANG", "LANGUAGE", "TZ", "TERM")
AGENT_ENV_ALLOWED_PREFIXES = ("LC_",)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def build_env(
    rec: RunRecord,
    paths: RunPaths,
    resume_dir: Path | None,
    *,
    home: str,
    agent_env: Mapping[str, str],
) -> dict[str, str]:
    """The command's environment, from an allow-list; never the agent's own environment.

    In order (later wins):

    1. ``PATH`` = ``/usr/local/bin:/usr/bin:/bin``, ``HOME`` = ``home``, and from
       ``agent_env`` only ``LANG``, ``LANGUAGE``, ``TZ``, ``TERM`` and ``LC_*``;
    2. the job's env as submitted (including ``PATH``, which the CLI sends from the submitting
       shell);
    3. the platform's variables, which a job cannot override: ``CUDA_VISIBLE_DEVICES`` (the
       reservation's GPU indexes, comma list; empty = no GPU), ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
       (so CUDA's numbering matches NVML's), ``GPUFLEET_JOB_ID``, ``GPUFLEET_RUN_ID``,
       ``GPUFLEET_ATTEMPT``, ``GPUFLEET_FENCING_TOKEN``, ``GPUFLEET_CHECKPOINT_DIR``,
       ``GPUFLEET_ARTIFACTS_DIR``, ``GPUFLEET_RESUME_FROM`` (a directory holding the
       previous attempt's checkpoints, or empty when there are none) and
       ``GPUFLEET_CHECKPOINT_DONE`` (the file to create once a checkpoint after SIGTERM is
       durable: the stop then ends without waiting out its grace), ``GPUFLEET_EXEC_ACTIVITY``
       (the agent's record of exec sessions, read by an interactive job's holder:
       :mod:`gpufleet.domain.interactive`); for a share of a GPU
       (``rec.gpu_milli``) also ``GPUFLEET_GPU_FRACTION`` (e.g. ``0.25``) and, on an MPS
       node, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its fraction of the GPU's SMs, percent:
       :func:`share_env`; docs/design/runtime.md says what each mode isolates).
    """
    env = {"PATH": DEFAULT_PATH, "HOME": home}
    for k, v in agent_env.items():
        if k in AGENT_ENV_ALLOWED or k.startswith(AGENT_ENV_ALLOWED_PREFIXES):
            env[k] = v
    env.update(rec.env)
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in rec.gpu_ids),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "GPUFLEET_JOB_ID": rec.job_id,
            "GPUFLEET_RUN_ID": rec.run_id,
            "GPUFLEET_ATTEMPT": str(rec.attempt),
            "GPUFLEET_FENCING_TOKEN": str(rec.token),
            "GPUFLEET_CHECKPOINT_DIR": str(paths.checkpoints),
            "GPUFLEET_ARTIFACTS_DIR": str(paths.artifacts),
            "GPUFLEET_RESUME_FROM": str(resume_dir) if resume_dir is not None else "",
            "GPUFLEET_CHECKPOINT_DONE": str(paths.checkpoint_done),
            ACTIVITY_ENV: str(paths.exec_activity),
            **share_env(rec.gpu_milli, rec.gpu_sharing),
        }
    )
    return env


def share_env(gpu_milli: int, gpu_sharing: str) -> dict[str, str]:
    """The variables of a GPU share (none for whole GPUs): ``GPUFLEET_GPU_FRACTION`` (the
    share, e.g. ``0.25``) and, where the node runs MPS, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
    (the share of the GPU's SMs the MPS server gives this client, percent, at least 1).
    Time-slicing sets no limit: CUDA has none to set without MPS or MIG."""
    if not gpu_milli:
        return {}
    env = {"GPUFLEET_GPU_FRACTION": f"{gpu_milli / 1000:g}"}
    if gpu_sharing == "mps":
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(gpu_milli / 10)))
    return env


CHECKPOINT_SCAN_MAX_ENTRIES = 10_000
"""The most directory entries :func:`newest_checkpoint_mtime` looks at per attempt and call."""

CHECKPOINT_SCAN_MAX_DEPTH = 32
"""The deepest directory level :func:`newest_checkpoint_mtime` enters (one open descriptor per
level while it walks)."""

CHECKPOINT_FUTURE_SKEW_S = 60.0
"""Seconds past the agent's clock a checkpoint file's time may be and still count (the same
allowance the controller gives a reported time, ``services.node_heartbeat``)."""


def newest_checkpoint_mtime(
    directory: Path,
    *,
    max_entries: int = CHECKPOINT_SCAN_MAX_ENTRIES,
    max_depth: int = CHECKPOINT_SCAN_MAX_DEPTH,
    not_after: float | None = None,
) -> float | None:
    """The newest modification time (wall clock, unix seconds) of a regular file anywhere
    under ``directory`` (an attempt's ``checkpoints/``), or None when it holds none or
    cannot be read. Heartbeats report it as the attempt's last checkpoint.

    Cheap and safe on a directory the job owns:

    - a walk of ``os.scandir`` over directory descriptors, each opened with ``O_NOFOLLOW``
      relative to its parent's: a symlink (to a file or a directory, ``directory`` itself
      included) is never followed, so nothing outside the directory is looked at;
    - at most ``max_entries`` entries (files, directories, anything else) are looked at, and
      no directory deeper than ``max_depth`` levels below ``directory``; a larger tree gives
      the newest time among the files seen (older than the truth at worst: a preemption then
      looks costlier, as it did before agents reported checkpoints);
    - an entry that cannot be read (no permission, removed while walking, a directory that
      cannot be opened) is skipped; an unreadable ``directory`` gives None. Never raises
      ``OSError``;
    - a file dated after ``not_after`` (unix seconds; default now +
      ``CHECKPOINT_FUTURE_SKEW_S``) is skipped: a restored or extracted file with a bad date
      would otherwise hide every real checkpoint written after it (the controller ignores a
      time far in the future).
    """
    if not_after is None:
        not_after = time.time() + CHECKPOINT_FUTURE_SKEW_S
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open(directory, flags)
    except OSError:
        return None
    newest: float | None = None
    seen = 0
    # one frame per open directory: its descriptor and the names of its subdirectories not
    # walked yet (a directory is listed whole before its subdirectories are entered)
    stack: list[tuple[int, list[str]]] = []
    fd: int | None = top
    try:
        while fd is not None or stack:
            if fd is not None:
                subdirs: list[str] = []
                try:
                    with os.scandir(fd) as entries:
                        for entry in entries:
                            seen += 1
                            if seen > max_entries:
                                os.close(fd)
                                return newest
                            try:
                                st = entry.stat(follow_symlinks=False)
                            except OSError:
                                continue  # vanished, or not ours to read: unknown, skipped
                            if stat.S_ISREG(st.st_mode):
                                if st.st_mtime > not_after:
                                    continue  # dated in the future: not a real checkpoint
                                if newest is None or st.st_mtime > newest:
                                    newest = st.st_mtime
                            elif stat.S_ISDIR(st.st_mode) and len(stack) < max_depth:
                                subdirs.append(entry.name)
                except OSError:
                    subdirs = []  # cannot be listed: unknown, skipped
                stack.append((fd, subdirs))
                fd = None
            parent, names = stack[-1]
            if not names:
                os.close(parent)
                stack.pop()
                continue
            try:
                fd = os.open(names.pop(), flags, dir_fd=parent)
            except OSError:
                fd = None  # replaced by a symlink, removed, or not ours to enter
        return newest
    finally:
        for parent, _ in stack:
            os.close(parent)


def download_prefix(store: ObjectStore, uri_or_key: str, dest: Path) -> int:
    """Download every object under a prefix (a URI in ``store`` or a bare key) into ``dest``,
    keeping relative paths. Returns the number of files.

    Raises:
        StartError: the URI is outside the store, or a download failed.
    """
    try:
        prefix = store.key_of(uri_or_key) if "://" in uri_or_key else uri_or_key
        prefix = prefix.strip("/")
        count = 0
        for key in store.list(prefix):
            rel = key[len(prefix) :].lstrip("/")
            target = (dest / rel).resolve()
            if not rel or not target.is_relative_to(dest.resolve()):
                continue  # "..": never write outside the resume directory
            store.get_file(key, target)
            count += 1
        return count
    except (OSError, ValueError) as exc:
        raise StartError(f"cannot download resume_from_uri {uri_or_key!r}: {exc}") from exc
