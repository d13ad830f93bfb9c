"""Containment of host-process attempts: one cgroup per attempt, or a PID namespace, or none.

Why a cgroup: a process group is a hint a job can leave (``setsid``, ``setpgid``), so stopping
"the group" and then checking it is empty proves nothing. A cgroup cannot be left by an
unprivileged process (moving a pid needs write access to the target's ``cgroup.procs``), all
descendants inherit it, and it carries the memory limit, the CPU quota and the OOM counters.

Kinds, best first (chosen once at agent start by :func:`detect`):

``cgroup-v2``
    The unified hierarchy (``/sys/fs/cgroup/cgroup.controllers`` exists). Groups live at
    ``/sys/fs/cgroup/gpufleet/{scope}/{run_id}`` with ``memory.max``, ``cpu.max``; stop
    uses ``cgroup.kill`` (Linux >= 5.14) or ``cgroup.freeze`` + SIGKILL; OOM from
    ``memory.events`` ``oom_kill``. Not exercised on the development machine (cgroup v1).
``cgroup-v1``
    One group per controller (``memory``, ``freezer`` required; ``pids``, ``cpu`` if mounted) at
    ``{mount}/{agent's own group}/gpufleet/{scope}/{run_id}``: nested under the agent's group
    so whatever limits the host puts on the agent also bound its jobs. Limit
    ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap accounting is
    on); quota ``cpu.cfs_quota_us``; stop = SIGTERM to every pid, grace, then freeze +
    SIGKILL every pid + thaw (the freeze closes the fork race); OOM from ``memory.oom_control``
    ``oom_kill`` (falls back to ``memory.failcnt``).
``pidns``
    No cgroup can be made (not root, no controller): the command runs as PID 1 of a new PID
    namespace (``unshare --pid --fork --kill-child``); when it dies the kernel kills every
    process of the namespace, so a ``setsid`` child cannot outlive it. No memory limit.
``none``
    Neither: the process group only (a ``setsid`` child escapes). Said once at agent start.

The cgroup paths are derivable from the run_id and also logged in the ``started`` event, so a
restarted agent finds the group of an attempt it adopts.

Container attempts (podman, :mod:`.container`) get a group of the same place and name
(:meth:`Containment.engine_parent`): it is the container's ``--cgroup-parent``, under which the
engine makes ``conmon/`` and ``libpod-<id>/``; the agent watches and, when the engine does not
answer, kills the whole tree.

**OOM, one rule for both runtimes** (:func:`oom_verdict`): an attempt was OOM-killed iff the
kernel's OOM-kill counter of its cgroup (:func:`oom_kills`: v2 ``memory.events`` ``oom_kill``,
hierarchical; v1 ``memory.oom_control`` ``oom_kill``, the group's own tasks only) is above zero
and its command did not succeed. Neither the exit code (137 is any SIGKILL) nor the memory
having reached the limit (page cache fills a limit without any OOM) decides it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("gpufleet.agent")

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_REQUIRED = ("memory", "freezer")
V1_OPTIONAL = ("pids", "cpu", "cpuacct")
CPU_PERIOD_US = 100_000
FREEZE_WAIT_S = 2.0
UNSHARE_PREFIX = (
    # absolute: the shim execs the prefix as root with the job's PATH in its environment
    shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin") or "/usr/bin/unshare",
    "--pid",
    "--fork",
    "--kill-child",
)


@dataclass(frozen=True, slots=True)
class Containment:
    """What this node can contain attempts in.

    Attributes:
        kind: ``cgroup-v2``, ``cgroup-v1``, ``pidns`` or ``none``.
        bases: directory under which per-attempt groups are made: v1 one per controller
            (``{"memory": Path, "freezer": Path, ...}``), v2 ``{"unified": Path}``.
        problem: why a better kind is not available ("" when it is a cgroup).
    """

    kind: str
    bases: dict[str, Path]
    problem: str = ""
    prefix: tuple[str, ...] = ()

    @property
    def is_cgroup(self) -> bool:
        return self.kind.startswith("cgroup")

    @property
    def pids(self) -> bool:
        """Whether attempts get a ``pids.max`` (v1: ``pids`` mounted and usable; v2: the
        ``pids`` controller enabled for the agent's groups)."""
        if self.kind == "cgroup-v1":
            return "pids" in self.bases
        if self.kind == "cgroup-v2":
            try:
                return "pids" in (self.bases["unified"] / "cgroup.subtree_control").read_text()
            except OSError:
                return False
        return False

    def group_for(self, run_id: str, *, cpu_quota: bool = True) -> JobCgroup | None:
        """The (not yet created) cgroup of one attempt; None without cgroups.

        Args:
            run_id: the attempt.
            cpu_quota: the attempt has a CPU quota. Without one it is not put in a v1 ``cpu``
                group of its own: group scheduling would weigh the whole job like a single
                thread against the host's other tasks and slow multi-threaded jobs down.
        """
        if not self.is_cgroup:
            return None
        dirs = {c: base / run_id for c, base in self.bases.items() if cpu_quota or c != "cpu"}
        return JobCgroup(self.kind, dirs)

    def engine_parent(self, run_id: str) -> tuple[str, JobCgroup] | None:
        """The cgroup a container engine puts one container attempt under, as the engine's
        ``--cgroup-parent`` (a path from the hierarchy's root) and as the group the agent
        watches (the engine makes ``conmon/`` and ``libpod-<id>/`` below it); None without
        cgroups.

        It is the attempt's own group name under this agent's groups: v2
        ``/gpufleet/{scope}/{run_id}``; v1 the memory group's path
        (``{agent's own memory group}/gpufleet/{scope}/{run_id}``) in every hierarchy, since
        the engine takes one path for all controllers (its groups in the other hierarchies
        may lie outside :attr:`bases`; :func:`remove_engine_parent` removes them all).
        """
        if not self.is_cgroup:
            return None
        if self.kind == "cgroup-v2":
            rel = self.bases["unified"].relative_to(CGROUP_ROOT) / run_id
            return "/" + str(rel), JobCgroup(self.kind, {"unified": CGROUP_ROOT / rel})
        mounts = _v1_mounts()
        try:
            rel = self.bases["memory"].relative_to(mounts["memory"]) / run_id
        except (KeyError, ValueError):
            return None
        dirs = {c: mounts[c] / rel for c in (*V1_REQUIRED, "pids") if c in mounts}
        return "/" + str(rel), JobCgroup(self.kind, dirs)

    def prune(self, keep: set[str]) -> list[str]:
        """Remove this agent's empty attempt groups not in ``keep`` (left by a crash between
        an attempt's end and its cleanup). Returns the run_ids of groups that could not be
        removed because processes are still in them (never killed here: the caller decides).
        """
        busy: set[str] = set()
        for base in self.bases.values():
            with contextlib.suppress(OSError):
                for d in base.iterdir():
                    if d.name in keep or d.name.startswith(".") or not d.is_dir():
                        continue
                    if not _rmtree(d):  # a container's tree: its empty sub-groups go too
                        busy.add(d.name)
        return sorted(busy)

    def remove_scope(self) -> None:
        """Remove this agent's (empty) parent groups, e.g. at a clean stop, also those a
        container engine made in the other hierarchies (:meth:`engine_parent`); groups of
        attempts still running keep them in place (rmdir fails with EBUSY/ENOTEMPTY)."""
        for base in self.bases.values():
            with contextlib.suppress(OSError):
                base.rmdir()
        found = self.engine_parent("x")
        if found is not None and self.kind == "cgroup-v1":
            rel = Path(found[0].strip("/")).parent
            for root in _engine_roots():
                with contextlib.suppress(OSError):
                    (root / rel).rmdir()

    def command_prefix(self, *, uid: int | None = None, gid: int | None = None) -> tuple[str, ...]:
        """argv prefix for the command (``unshare ...`` for pidns; empty otherwise). With
        ``uid``/``gid``, unshare (run as root) switches to them for the command (and drops
        the supplementary groups)."""
        if self.kind != "pidns":
            return ()
        ids: tuple[str, ...] = ()
        if gid is not None:
            ids += ("--setgid", str(gid))
        if uid is not None:
            ids += ("--setuid", str(uid))
        return (*self.prefix, *ids, "--")


def detect(scope: str, *, want: str = "auto") -> Containment:
    """Find the best containment this process can use (see module doc).

    Args:
        scope: this agent's name among the agents of the host (a path component of the
            groups, ``{node_id}-{hash of state dir}``).
        want: ``auto``, or force a weaker kind (``pidns``, ``none``) for tests and operators.
    """
    problems: list[str] = []
    if want == "auto":
        if os.geteuid() != 0:
            problems.append("the agent is not root, so it cannot create cgroups")
        else:
            found = _try_v2(scope, problems) if _is_v2() else _try_v1(scope, problems)
            if found is not None:
                return found
    if want in ("auto", "pidns"):
        prefix = UNSHARE_PREFIX if os.geteuid() == 0 else (UNSHARE_PREFIX[0], "--map-current-user")
        prefix = (*prefix, *UNSHARE_PREFIX[1:]) if prefix != UNSHARE_PREFIX else prefix
        if _pidns_works(prefix):
            return Containment("pidns", {}, "; ".join(problems), prefix)
        problems.append(f"{' '.join(prefix)} does not work here")
    return Containment("none", {}, "; ".join(problems) or f"containment forced to {want}")


def remove_engine_parent(parent: str) -> bool:
    """Remove a container attempt's ``--cgroup-parent`` (:meth:`Containment.engine_parent`)
    and the empty groups the engine left below it, in every mounted hierarchy (v2: the
    unified one). True when nothing of it is left (False: a process is still in it)."""
    rel = parent.strip("/")
    if not rel:
        return True
    ok = True
    for root in _engine_roots():
        d = root / rel
        if d.is_dir():
            ok = _rmtree(d) and ok
    return ok


def _engine_roots() -> list[Path]:
    """Where an engine makes a container's groups: v2 the unified root; v1 every mounted
    hierarchy, and the cgroup2 one of a hybrid host (runc makes groups there too)."""
    if _is_v2():
        return [CGROUP_ROOT]
    roots = set(_v1_mounts().values())
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "cgroup2":
                roots.add(Path(parts[1]))
    return sorted(roots)


def _is_v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def _own_groups() -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller: path} (v2: key "")."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _id, controllers, path = line.split(":", 2)
            for c in controllers.split(","):
                out[c] = path
    return out


def _v1_mounts() -> dict[str, Path]:
    """{controller: mount point} of the mounted v1 hierarchies."""
    mounts: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "cgroup":
                for opt in parts[3].split(","):
                    mounts.setdefault(opt, Path(parts[1]))
    return mounts


def _try_v1(scope: str, problems: list[str]) -> Containment | None:
    mounts, own = _v1_mounts(), _own_groups()
    bases: dict[str, Path] = {}
    for c in (*V1_REQUIRED, *V1_OPTIONAL):
        if c not in mounts:
            if c in V1_REQUIRED:
                problems.append(f"cgroup v1 controller {c!r} is not mounted")
                return None
            continue
        base = mounts[c] / own.get(c, "/").lstrip("/") / "gpufleet" / scope
        try:
            base.mkdir(parents=True, exist_ok=True)
            probe = base / f".probe-{os.getpid()}"
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            if c in V1_REQUIRED:
                problems.append(f"cannot create a {c} cgroup under {base}: {exc}")
                return None
            logger.warning("cgroup v1 %s unusable (%s); jobs get no %s limit", c, exc, c)
            continue
        bases[c] = base
    return Containment("cgroup-v1", bases)


def _try_v2(scope: str, problems: list[str]) -> Containment | None:
    # Processes may only sit in leaves once controllers are enabled below a group, so the
    # groups go in a subtree of their own at the root (the root is exempt from that rule).
    base = CGROUP_ROOT / "gpufleet" / scope
    try:
        for d in (CGROUP_ROOT, CGROUP_ROOT / "gpufleet", base):
            d.mkdir(exist_ok=True)
            available = set((d / "cgroup.controllers").read_text().split())
            wanted = [c for c in ("memory", "pids", "cpu") if c in available]
            if "memory" not in wanted:
                problems.append(f"cgroup v2: no memory controller at {d}")
                return None
            (d / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
    except OSError as exc:
        problems.append(f"cgroup v2: cannot set up {base}: {exc}")
        return None
    return Containment("cgroup-v2", {"unified": base})


def _pidns_works(prefix: tuple[str, ...]) -> bool:
    if shutil.which(prefix[0]) is None:
        return False
    try:
        done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@dataclass(frozen=True, slots=True)
class JobCgroup:
    """The cgroup(s) of one attempt.

    Attributes:
        kind: ``cgroup-v1`` or ``cgroup-v2``.
        dirs: v1 {controller: dir}; v2 {"unified": dir}.
    """

    kind: str
    dirs: dict[str, Path]

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "dirs": {c: str(d) for c, d in self.dirs.items()}}

    @staticmethod
    def from_json(data: dict[str, object]) -> JobCgroup:
        dirs = data.get("dirs") or {}
        assert isinstance(dirs, dict)
        return JobCgroup(str(data["kind"]), {str(c): Path(str(d)) for c, d in dirs.items()})

    @property
    def _main(self) -> Path:
        return self.dirs["unified"] if self.kind == "cgroup-v2" else self.dirs["memory"]

    # ------------------------------------------------------------------ set up

    @property
    def has_pids(self) -> bool:
        """Whether ``pids.max`` can be set (v1: the ``pids`` controller is mounted)."""
        return self.kind == "cgroup-v2" or "pids" in self.dirs

    def create(self, *, memory_mb: int, cpu: float, pids_max: int = 0) -> None:
        """Make the group(s) and set the limits. Idempotent.

        Args:
            memory_mb: MiB; 0 = none.
            cpu: cores (a CFS quota); 0 = none.
            pids_max: processes and threads at once (``pids.max``); 0 = none. A ``fork`` or
                ``clone`` past it fails with EAGAIN inside the group only. Without a
                ``pids`` controller it is not set (the agent says so at start and in the
                node label ``gpufleet/job-pids-max``).

        Raises:
            OSError: a group or a limit could not be written.
        """
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        limit = memory_mb * 1024 * 1024 if memory_mb > 0 else 0
        quota = int(cpu * CPU_PERIOD_US) if cpu > 0 else 0
        if pids_max > 0 and self.has_pids:
            pids = self.dirs["unified"] if self.kind == "cgroup-v2" else self.dirs["pids"]
            if self.kind != "cgroup-v2" or (pids / "pids.max").exists():  # v2: enabled above
                (pids / "pids.max").write_text(str(pids_max))
        if self.kind == "cgroup-v2":
            d = self.dirs["unified"]
            if limit:
                (d / "memory.max").write_text(str(limit))
                with contextlib.suppress(OSError):
                    (d / "memory.swap.max").write_text("0")
            if quota:
                with contextlib.suppress(OSError):
                    (d / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
            return
        mem = self.dirs["memory"]
        if limit:
            (mem / "memory.limit_in_bytes").write_text(str(limit))
            with contextlib.suppress(OSError):  # only where swap accounting is on
                (mem / "memory.memsw.limit_in_bytes").write_text(str(limit))
        if quota and "cpu" in self.dirs:
            with contextlib.suppress(OSError):
                (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))

    def procs_files(self) -> list[Path]:
        """The ``cgroup.procs`` files a process writes its pid to, to join (all controllers)."""
        return [d / "cgroup.procs" for d in self.dirs.values()]

    # ------------------------------------------------------------------ watch and stop

    def exists(self) -> bool:
        return self._main.is_dir()

    def pids(self) -> set[int]:
        """Every live process of the attempt: union over the controllers' groups and the
        groups below them (a container engine's ``conmon/`` and ``libpod-<id>/``, or groups a
        root job made); zombies are not listed. Empty when the group does not exist."""
        found: set[int] = set()
        for d in self.dirs.values():
            for sub, _dirs, _files in os.walk(d):
                try:
                    text = (Path(sub) / "cgroup.procs").read_text()
                except OSError:  # gone meanwhile
                    continue
                found.update(int(p) for p in text.split())
        return found

    def signal_all(self, sig: int, *, exclude: frozenset[int] = frozenset()) -> int:
        """Send ``sig`` to every process of the group but ``exclude``. Returns how many were
        signalled."""
        n = 0
        for pid in self.pids() - exclude:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                n += 1
        return n

    def kill_all(self, *, exclude: frozenset[int] = frozenset()) -> None:
        """SIGKILL every process without a fork race: ``cgroup.kill`` (v2; not with
        ``exclude``), else freeze, SIGKILL each pid but ``exclude``, thaw (the kernel
        delivers the pending SIGKILLs on thaw)."""
        if self.kind == "cgroup-v2" and not exclude:
            kill_file = self.dirs["unified"] / "cgroup.kill"
            if kill_file.exists():
                kill_file.write_text("1")
                return
        with self._frozen():
            self.signal_all(signal.SIGKILL, exclude=exclude)

    @contextlib.contextmanager
    def _frozen(self):  # type: ignore[no-untyped-def]
        if self.kind == "cgroup-v2":
            f, frozen, thawed = self.dirs["unified"] / "cgroup.freeze", "1", "0"
        elif "freezer" in self.dirs:
            f, frozen, thawed = self.dirs["freezer"] / "freezer.state", "FROZEN", "THAWED"
        else:
            yield
            return
        try:
            f.write_text(frozen)
            deadline = time.monotonic() + FREEZE_WAIT_S
            while time.monotonic() < deadline and not self._is_frozen():
                time.sleep(0.01)
        except OSError:
            logger.warning("cannot freeze %s; killing without a freeze", f.parent)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                f.write_text(thawed)

    def _is_frozen(self) -> bool:
        try:
            if self.kind == "cgroup-v2":
                events = (self.dirs["unified"] / "cgroup.events").read_text()
                return "frozen 1" in events
            return (self.dirs["freezer"] / "freezer.state").read_text().strip() == "FROZEN"
        except OSError:
            return True

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer acted in this group (its memory limit was hit)."""
        kills = self.oom_kills()
        if self.kind == "cgroup-v2" or kills >= 0:
            return kills > 0
        try:  # kernels before 4.13 have no oom_kill counter: the limit was hit at least
            return int((self.dirs["memory"] / "memory.failcnt").read_text()) > 0
        except (OSError, ValueError):
            return False

    def oom_kills(self) -> int:
        """:func:`oom_kills` of this group (v1: its memory group); -1 when unknown."""
        return oom_kills(self._main)

    def pids_limit_hit(self) -> int:
        """How often a fork was refused at ``pids.max`` (``pids.events`` ``max``); 0 when
        never or unknown."""
        d = self.dirs.get("unified") if self.kind == "cgroup-v2" else self.dirs.get("pids")
        return max(0, _counter(d / "pids.events", "max")) if d is not None else 0

    def memory_limit_mb(self) -> int:
        """The memory limit in MiB (0 = none or unknown)."""
        try:
            if self.kind == "cgroup-v2":
                raw = (self.dirs["unified"] / "memory.max").read_text().strip()
                return 0 if raw == "max" else int(raw) // (1024 * 1024)
            raw = (self.dirs["memory"] / "memory.limit_in_bytes").read_text().strip()
            value = int(raw)
            return 0 if value >= 1 << 62 else value // (1024 * 1024)
        except (OSError, ValueError):
            return 0

    def usage(self) -> dict[str, int | float]:
        """What the group's processes used, read before it is removed: ``peak_rss_bytes``
        (v2 ``memory.peak``, Linux >= 5.19; v1 ``memory.max_usage_in_bytes``: page cache
        included, as the limit counts it) and ``cpu_seconds`` (v2 ``cpu.stat``
        ``usage_usec``; v1 ``cpuacct.usage``, ns), user + system. Each is left out when the
        kernel does not give it; never raises."""
        out: dict[str, int | float] = {}
        if self.kind == "cgroup-v2":
            d = self.dirs["unified"]
            peak = _read_int(d / "memory.peak")
            usec = _counter(d / "cpu.stat", "usage_usec")
            if usec >= 0:
                out["cpu_seconds"] = usec / 1e6
        else:
            peak = _read_int(self.dirs["memory"] / "memory.max_usage_in_bytes")
            acct = self.dirs.get("cpuacct") or self.dirs.get("cpu")
            ns = _read_int(acct / "cpuacct.usage") if acct is not None else -1
            if ns >= 0:
                out["cpu_seconds"] = ns / 1e9
        if peak >= 0:
            out["peak_rss_bytes"] = peak
        return out

    def remove(self) -> bool:
        """Remove the group(s) and the empty groups below them (bottom-up); False while a
        process is left (EBUSY) — retried later."""
        ok = True
        for d in self.dirs.values():
            ok = _rmtree(d) and ok
        return ok


def _read_int(path: Path) -> int:
    """The integer a cgroup file holds, or -1 (missing, unreadable, not a number)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def _rmtree(d: Path) -> bool:
    """rmdir ``d`` and its sub-groups, deepest first; True when ``d`` is gone."""
    subs = sorted((Path(p) for p, _, _ in os.walk(d)), key=lambda p: len(p.parts), reverse=True)
    for sub in subs:
        with contextlib.suppress(OSError):
            sub.rmdir()
    return not d.exists()


def oom_kills(directory: Path) -> int:
    """How many processes the kernel's OOM killer killed in one cgroup directory.

    v2: ``memory.events`` ``oom_kill`` (counts the whole subtree); v1:
    ``memory.oom_control`` ``oom_kill`` (the group's own tasks only, Linux >= 4.13). A
    *copy* of those files (the container runtime's saved counters) is read the same way: any
    file whose lines hold ``oom_kill N``.

    Args:
        directory: a cgroup directory, or a saved counters file.

    Returns:
        The count; -1 when unknown (no such group, no counter on this kernel).
    """
    if directory.is_file():
        return _counter(directory, "oom_kill")
    for name in ("memory.events", "memory.oom_control"):
        n = _counter(directory / name, "oom_kill")
        if n >= 0:
            return n
    return -1


def oom_verdict(kills: int, exit_code: int) -> bool:
    """THE OOM rule of both runtimes: the attempt is ``OOM_KILLED`` iff the kernel's OOM
    killer acted in its cgroup (``kills`` > 0, from :func:`oom_kills`) and the command did
    not succeed (``exit_code`` != 0; a job whose child was OOM-killed but that exited 0 is a
    success). ``kills`` -1 (unknown) is no verdict: False."""
    return kills > 0 and exit_code != 0


def _counter(path: Path, name: str) -> int:
    """Value of ``name N`` in a flat-keyed cgroup file; -1 when absent or unreadable."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return -1
