"""Who an attempt's command runs as: never the agent's own user.

The agent runs as root on a real node (it makes cgroups and switches users). Jobs run as the
unprivileged *job user* (``gpufleet agent --job-user NAME``, default ``gpufleet-job``, created
with ``useradd --system`` when missing):

* ``--job-uids per-attempt`` (default): each attempt gets its own uid, ``uid_base + n`` with
  ``n`` derived from the run_id (CRC-32, probed past uids held by other live attempts here),
  and the job user's group as its gid. Two attempts therefore never share a uid, which is what
  keeps one job from reading another's work/checkpoint/artifact directories (mode 0700) and its
  ``/proc/PID/environ`` (the kernel lets a uid read its own processes' environ). The uids need
  no ``/etc/passwd`` entry (like systemd's DynamicUser); ``HOME`` is the attempt's work dir.
* ``--job-uids shared``: every attempt runs as the job user's own uid. Simpler to audit
  (``ps`` shows a name), but jobs on one node can read each other's files and environ.

* ``--job-uids agent``: jobs run as the agent's own user. No isolation at all: for a
  development box whose job software is readable by its owner only (e.g. a Python under a 0700
  ``/root``), never for a shared node. Logged as a warning at every start.

An agent that is not root cannot switch users: it says so once at start, runs jobs as itself
and shows ``jobs-as-agent-user`` in ``gpufleet nodes`` (as with ``--job-uids agent``).
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import shutil
import subprocess
import zlib
from collections.abc import Collection
from dataclasses import dataclass

from gpufleet.agent.runtime.base import JobUser

logger = logging.getLogger("gpufleet.agent")

DEFAULT_JOB_USER = "gpufleet-job"
DEFAULT_UID_BASE = 1_900_000_000
DEFAULT_UID_COUNT = 1 << 20


@dataclass(frozen=True, slots=True)
class JobUsers:
    """The policy for choosing an attempt's user (see module doc).

    Attributes:
        name: the job user's name ("" when the agent cannot switch users).
        uid, gid: the job user's ids.
        per_attempt: each attempt gets its own uid from ``[uid_base, uid_base + uid_count)``.
        switch: False when the agent cannot change users (not root).
    """

    name: str
    uid: int
    gid: int
    per_attempt: bool = True
    switch: bool = True
    uid_base: int = DEFAULT_UID_BASE
    uid_count: int = DEFAULT_UID_COUNT

    def describe(self) -> str:
        """For ``gpufleet nodes``: ``jobs-as-agent-user``, ``gpufleet-job`` or
        ``gpufleet-job/uid-per-attempt``."""
        if not self.switch:
            return "jobs-as-agent-user"
        return f"{self.name}/uid-per-attempt" if self.per_attempt else self.name

    def for_run(self, run_id: str, *, home: str, taken: Collection[int] = ()) -> JobUser:
        """The user of one attempt.

        Args:
            run_id: the attempt.
            home: its ``HOME``.
            taken: uids of other live attempts on this node (never shared).
        """
        if not self.switch:
            return JobUser(os.getuid(), os.getgid(), (), self.name, home, switch=False)
        if not self.per_attempt:
            return JobUser(self.uid, self.gid, (), self.name, home)
        n = zlib.crc32(run_id.encode()) % self.uid_count
        for _ in range(self.uid_count):
            uid = self.uid_base + n
            if uid not in taken:
                return JobUser(uid, self.gid, (), self.name, home)
            n = (n + 1) % self.uid_count
        raise RuntimeError("no free job uid")  # pragma: no cover - a million live attempts


JOB_UIDS_MODES = ("per-attempt", "shared", "agent")


def resolve(name: str = DEFAULT_JOB_USER, *, mode: str = "per-attempt") -> JobUsers:
    """Find (or, as root, create) the job user.

    Args:
        name: the job user.
        mode: one of :data:`JOB_UIDS_MODES` (see module doc).

    Raises:
        ValueError: ``mode`` is unknown, ``name`` is the agent's own user or root, or it cannot
            be created.
    """
    if mode not in JOB_UIDS_MODES:
        raise ValueError(f"job uids {mode!r}: use one of {', '.join(JOB_UIDS_MODES)}")
    me = pwd.getpwuid(os.getuid()).pw_name
    if os.geteuid() != 0 or mode == "agent":
        why = "--job-uids agent" if mode == "agent" else "the agent is not root"
        logger.warning(
            "jobs run as the agent's own user %s (%s): they can read the agent's files", me, why
        )
        return JobUsers(me, os.getuid(), os.getgid(), per_attempt=False, switch=False)
    per_attempt = mode == "per-attempt"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        entry = _create(name)
    if entry.pw_uid == 0 or entry.pw_uid == os.geteuid():
        raise ValueError(f"--job-user {name!r} is the agent's own user; jobs must not run as it")
    return JobUsers(name, entry.pw_uid, entry.pw_gid, per_attempt=per_attempt)


def _create(name: str) -> pwd.struct_passwd:
    useradd = shutil.which("useradd")
    if useradd is None:
        raise ValueError(f"job user {name!r} does not exist and useradd is not installed")
    shell = shutil.which("nologin") or "/bin/false"
    argv = [useradd, "--system", "--user-group", "--no-create-home"]
    argv += ["--home-dir", "/nonexistent", "--shell", shell, name]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(
            f"cannot create job user {name!r}: {done.stderr.strip() or done.returncode}"
        ) from None
    logger.info("created the job user %s (uid %d)", name, entry.pw_uid)
    return entry


def executable_by_others(path: str | os.PathLike[str]) -> bool:
    """Whether a user other than the owner can run ``path`` (symlinks resolved): every
    ancestor directory searchable by others and the file executable by others. ACLs and
    group membership are not considered."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & 0o001:
            return False
        parent = os.path.dirname(real)
        while True:
            if not os.stat(parent).st_mode & 0o001:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
