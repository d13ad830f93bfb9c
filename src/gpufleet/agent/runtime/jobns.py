"""What a process job sees of the node besides its cgroup: privileges, /tmp, /proc.

Found once at agent start (:func:`detect`), said in the log and in the node label
``gpufleet/job-isolation`` (``gpufleet nodes --wide``), and applied to every process attempt
that runs as a job user:

* **no_new_privs** (``setpriv --no-new-privs`` before the shim): nothing the job execs gains
  privileges, so a setuid-root binary (or one with file capabilities) on the host runs with
  the job's own uid. Inherited by every process of the attempt; the shim itself only ever
  drops privileges (``setpriv --reuid``), which the flag allows.
* **a mount and an IPC namespace of its own** (``unshare --mount --ipc --propagation
  private`` before the shim; SysV IPC and POSIX message queues are the attempt's own): the
  shim's child, still root and already in the attempt's cgroup, binds the attempt's ``tmp/``
  directory (inside its scratch filesystem, so bounded by ``disk_mb``) on ``/tmp`` and
  ``/var/tmp``, mounts a fresh tmpfs on ``/dev/shm`` (pages charged to the job's memory
  cgroup) and a new ``proc`` with ``hidepid=invisible`` on ``/proc``: the job sees only its
  own uid's processes, so not another job's ``/proc/PID/cmdline`` nor the shim's argv
  (root's). Nothing of it propagates to the host; it ends with the attempt's last process.
* **no node sockets**: the job's network namespace cuts TCP, but a Unix socket is a file: the
  shim mounts an empty tmpfs on each of :data:`HIDDEN_DIRS` that exists on the node (``/run``
  with PostgreSQL's, MySQL's, Redis's, podman's, Docker's and D-Bus's sockets; ``/var/run``
  where it is not the usual symlink to ``/run``; MySQL's and Postfix's directories under
  ``/var``), so a job cannot connect to a node daemon whatever its socket's permissions.
  ``/etc/resolv.conf`` pointing into one of them (systemd-resolved's
  ``/run/systemd/resolve/stub-resolv.conf``) is bound back at its place. Abstract sockets
  belong to the network namespace and are cut with it.

``hidepid`` needs Linux 5.8 or later (each ``proc`` mount its own instance; on older kernels
the option would change the host's ``/proc``, so it is not used there). A namespace needs root.
Everything is named by absolute path, found with the agent's own ``PATH``: the job's ``PATH``
(the shim's environment) never chooses a program that runs as root.

Jobs run as the agent's own user (``--job-uids agent``, or an agent that is not root) get
none of the namespace (no isolation is promised there), but still no_new_privs.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("gpufleet.agent")

SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""Where the isolation programs are looked up (the agent's ``PATH`` first)."""
HIDEPID_MIN_KERNEL = (5, 8)
HIDDEN_DIRS = ("/run", "/var/run", "/var/lib/mysql", "/var/spool/postfix")
"""Directories holding node daemons' listening Unix sockets on a Debian host, each hidden
under an empty tmpfs in a job's mount namespace (those that exist and are not symlinks)."""
KEPT_FILES = ("/etc/resolv.conf",)
"""Files a job needs that may be symlinks into a hidden directory (the target is bound back)."""


def _which(name: str) -> str | None:
    path = os.environ.get("PATH", "")
    return shutil.which(name, path=f"{path}:{SEARCH_PATH}" if path else SEARCH_PATH)


def _kernel() -> tuple[int, int]:
    try:
        major, minor = platform.release().split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


@dataclass(frozen=True, slots=True)
class Isolation:
    """The node's isolation of process jobs beyond containment (see module doc).

    Attributes:
        setpriv: absolute path of util-linux ``setpriv`` for no_new_privs ("" = unavailable).
        unshare: absolute path of ``unshare`` for the mount namespace ("" = no namespace).
        mount: absolute path of ``mount``, run by the shim inside the namespace.
        hide_pids: mount a ``proc`` with ``hidepid=invisible`` in the namespace.
        hide_dirs: absolute paths hidden under an empty tmpfs (see :data:`HIDDEN_DIRS`).
        keep_file: resolv.conf's target when it lies in one of ``hide_dirs`` ("" = none).
        problems: what is missing and why, one line each (logged at agent start).
    """

    setpriv: str = ""
    unshare: str = ""
    mount: str = ""
    hide_pids: bool = False
    problems: tuple[str, ...] = field(default=())
    hide_dirs: tuple[str, ...] = field(default=())
    keep_file: str = ""

    @property
    def no_new_privs(self) -> bool:
        return bool(self.setpriv)

    @property
    def mount_ns(self) -> bool:
        return bool(self.unshare and self.mount)

    def describe(self, *, namespace: bool = True) -> str:
        """For the node label: the features in force, ``.``-separated (a label value), e.g.
        ``no-new-privs.private-tmp.hidepid`` (``none`` when there is none).

        Args:
            namespace: jobs run as job users (else they get no namespace: see module doc).
        """
        parts = []
        if self.no_new_privs:
            parts.append("no-new-privs")
        if self.mount_ns and namespace:
            parts.append("private-tmp")
            if self.hide_pids:
                parts.append("hidepid")
            if self.hide_dirs:
                parts.append("no-node-sockets")
        return ".".join(parts) or "none"

    def shim_prefix(self, *, namespace: bool) -> list[str]:
        """The argv that runs the shim (``setpriv --no-new-privs`` and, with ``namespace``
        and where the node can, ``unshare --mount --propagation private``). Empty when the
        node has neither."""
        out: list[str] = []
        if self.setpriv:
            out += [self.setpriv, "--no-new-privs", "--"]
        if namespace and self.mount_ns:
            out += [self.unshare, "--mount", "--ipc", "--propagation", "private", "--"]
        return out

    def shim_options(self, *, namespace: bool, tmp_dir: str) -> dict[str, Any]:
        """Keyword arguments of :func:`gpufleet.agent.shim.argv` for the mounts the shim's
        child makes in the namespace (none without one). A hidden directory that holds
        ``tmp_dir`` (an agent data directory under ``/run``) stays visible."""
        if not (namespace and self.mount_ns):
            return {}
        hide = tuple(d for d in self.hide_dirs if not _within(tmp_dir, d))
        keep = self.keep_file if any(_within(self.keep_file, d) for d in hide) else ""
        return {
            "mount_bin": self.mount,
            "private_tmp": tmp_dir,
            "hide_pids": self.hide_pids,
            "hide_dirs": hide,
            "keep_file": keep,
        }


def _within(path: str, directory: str) -> bool:
    return bool(path) and (path == directory or path.startswith(directory.rstrip("/") + "/"))


def hidden_dirs(candidates: tuple[str, ...] = HIDDEN_DIRS) -> tuple[str, ...]:
    """The ``candidates`` that exist as directories and are not symlinks (a symlink such as
    ``/var/run -> /run`` is hidden with its target), outermost first, none inside another."""
    out: list[str] = []
    for path in candidates:
        if os.path.isdir(path) and not os.path.islink(path):
            real = os.path.realpath(path)
            if not any(_within(real, d) for d in out):
                out.append(real)
    return tuple(out)


def kept_file(hide: tuple[str, ...], candidates: tuple[str, ...] = KEPT_FILES) -> str:
    """The real path of the first of ``candidates`` that is a symlink resolving into one of
    ``hide`` ("" when none: a regular ``/etc/resolv.conf`` needs nothing)."""
    for path in candidates:
        if os.path.islink(path):
            real = os.path.realpath(path)
            if os.path.isfile(real) and any(_within(real, d) for d in hide):
                return real
    return ""


NONE = Isolation(problems=("not probed",))

LOADER_VARIABLES = frozenset(
    # what glibc drops for setuid programs (UNSECURE_ENVVARS) besides every LD_* name: a
    # program run as root honours each of them (LD_PRELOAD: any library, as root)
    {
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_ARENA_MAX",
        "MALLOC_ARENA_TEST",
        "MALLOC_CHECK_",
        "MALLOC_MMAP_MAX_",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_PERTURB_",
        "MALLOC_TOP_PAD_",
        "MALLOC_TRACE",
        "MALLOC_TRIM_THRESHOLD_",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TMPDIR",
        "TZDIR",
    }
)
"""Variables of the dynamic loader and libc that must never reach a program the agent runs as
root around a job (the prefix, the shim, ``mount``); every ``LD_*`` name too."""
HIDDEN_PREFIX = "_GF_ENV_"
"""The shim's environment holds a job's loader variable ``X`` as ``_GF_ENV_X``; the shim puts
it back as ``X`` only in the command's own process, after the switch to the job's user."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def hide_loader_env(env: Mapping[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """``env`` with each loader variable (:data:`LOADER_VARIABLES`, ``LD_*``) renamed to
    ``_GF_ENV_<name>``, and the names renamed (sorted; give them to the shim's
    ``restore_env``). Names that are not shell identifiers are left as they are (no loader
    reads them)."""
    out: dict[str, str] = {}
    hidden: list[str] = []
    for key, value in env.items():
        if (key.startswith("LD_") or key in LOADER_VARIABLES) and _NAME.match(key):
            out[HIDDEN_PREFIX + key] = value
            hidden.append(key)
        else:
            out[key] = value
    return out, tuple(sorted(hidden))


def detect() -> Isolation:
    """Probe what this node can do (one ``setpriv`` and one ``unshare`` run, ~10 ms).
    Never raises: what does not work is in ``problems``."""
    problems: list[str] = []
    setpriv = _which("setpriv") or ""
    if not setpriv:
        problems.append("setpriv (util-linux) is not installed: jobs run without no_new_privs")
    elif not _runs([setpriv, "--no-new-privs", "--", "/bin/true"]):
        problems.append(f"{setpriv} --no-new-privs does not work: jobs run without it")
        setpriv = ""
    unshare, mount, hide = _which("unshare") or "", _which("mount") or "", False
    if os.geteuid() != 0:
        problems.append("the agent is not root: jobs share the node's /tmp and see its /proc")
        unshare = ""
    elif not unshare or not mount:
        problems.append("unshare or mount is not installed: jobs share /tmp and /proc")
        unshare = ""
    else:
        ns = [unshare, "--mount", "--ipc", "--propagation", "private", "--"]
        if not _runs([*ns, mount, "-t", "tmpfs", "-o", "size=64k,nosuid,nodev", "tmpfs", "/tmp"]):
            problems.append("cannot make a mount namespace: jobs share /tmp and /proc")
            unshare = ""
        elif _kernel() < HIDEPID_MIN_KERNEL:
            problems.append(
                f"Linux {platform.release()} is older than 5.8 (one proc instance per PID "
                "namespace): jobs see every process in /proc"
            )
        elif not _runs([*ns, mount, "-t", "proc", "-o", "hidepid=invisible", "proc", "/proc"]):
            problems.append("cannot mount /proc with hidepid: jobs see every process in /proc")
        else:
            hide = True
    dirs = hidden_dirs() if unshare else ()
    return Isolation(
        setpriv,
        unshare,
        mount if unshare else "",
        hide,
        tuple(problems),
        hide_dirs=dirs,
        keep_file=kept_file(dirs),
    )


def _runs(argv: list[str]) -> bool:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=10, env={"PATH": SEARCH_PATH})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
