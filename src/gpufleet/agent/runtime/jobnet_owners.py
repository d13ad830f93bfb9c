"""Who owns a tag's job-network objects, and the sweep of those whose agent is gone.

An agent's job namespaces (``/run/netns/gf-{tag}-{h}``), host-side veths (``gf{tag}{h}``) and
nftables table (``table inet gpufleet_{tag}``) outlive it: a running job keeps working while
its agent restarts, and a restart on the same state dir (the same ``tag``) adopts it and
prunes the rest. An agent killed with SIGKILL (the OOM killer, ``kill -9``) whose state dir
is never used again (a wiped node, a test's temporary dir) left them behind for good.

So whatever makes a tag's objects first records its owner here, one small file per tag in
:data:`REGISTRY_DIR` (tmpfs: gone at reboot, as the namespaces are): the owner's pid, its
start time (clock ticks since boot, against pid reuse) and the boot id. Every agent that
starts with job namespaces calls :func:`sweep`, which removes the objects of tags whose owner
is gone, under the host lock the agents already share for address allocation:

* a namespace that a live process is still in is **kept**, with its veth, and so is the
  tag's table (it is that job's filter; without it the job would reach the node's services),
  as is the table of a tag whose host-network jobs' uids still run; an agent restarting on
  the same state dir adopts such a job in the namespace it had, and a later sweep removes
  what is left once the job has ended;
* the record goes once nothing of the tag is left;
* objects of a tag with no record are never touched: their owner may be an agent of an
  older version that does not record itself and may still run.

The record is written by the process that makes the objects: the agent (:meth:`claim` at its
start takes the tag over from a dead predecessor), or whoever calls ``JobNet.create`` for a
tag nobody live owns.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.agent import procfs

logger = logging.getLogger("gpufleet.agent")

NETNS_DIR = Path("/run/netns")
REGISTRY_DIR = Path("/run/gpufleet/jobnet")
"""One ``{tag}.json`` per tag: its owner (see the module doc)."""
HOST_LOCK = Path("/run/gpufleet-jobnet.lock")
"""Serialises address allocation, ownership records and sweeps between the agents of one
host (the path older agents use too, so they stay serialised with this one)."""
CMD_TIMEOUT_S = 20.0

NS_RE = re.compile(r"gf-([0-9a-f]{4})-([0-9a-f]{8})")
"""``JobNet.ns_name``: ``gf-{tag}-{hash of the run_id}``."""
LINK_RE = re.compile(r"gf([0-9a-f]{4})([0-9a-f]{8})")
"""``JobNet.host_if``: ``gf{tag}{hash of the run_id}``."""
TABLE_RE = re.compile(r"table inet gpufleet_([0-9a-f]{4})")
"""``JobNet.table`` as ``nft list tables`` prints it."""


@dataclass(frozen=True, slots=True)
class Owner:
    """The process that owns a tag's objects.

    Attributes:
        tag: the 4 hex digits in the objects' names.
        scope: the owner's ``agent_scope`` (for people reading the file).
        pid: the owner's pid.
        start_ticks: its start time (``/proc/{pid}/stat`` field 22).
        boot_id: the boot it ran in.
        job_uids: inclusive uid ranges of its host-network jobs (its table filters them).
    """

    tag: str
    scope: str
    pid: int
    start_ticks: int
    boot_id: str
    job_uids: tuple[tuple[int, int], ...] = ()

    def alive(self, ended: frozenset[int] = frozenset()) -> bool:
        """Whether the owner still runs (the same process: pid, start time, boot); a pid in
        ``ended`` counts as gone (a test session at its end, its in-process agents stopped)."""
        if self.pid in ended or self.boot_id != procfs.boot_id():
            return False
        return procfs.is_same_process_alive(self.pid, self.start_ticks)

    def to_json(self) -> dict[str, object]:
        return {
            "scope": self.scope,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "boot_id": self.boot_id,
            "job_uids": [list(r) for r in self.job_uids],
        }


@dataclass(slots=True)
class Swept:
    """What :func:`sweep` removed and kept (names)."""

    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Objects of gone owners kept because a job still uses them."""

    def __bool__(self) -> bool:
        return bool(self.namespaces or self.links or self.tables or self.kept)

    def describe(self) -> str:
        parts = [
            f"{len(self.namespaces)} namespace(s)",
            f"{len(self.links)} veth(s)",
            f"{len(self.tables)} nftables table(s)",
        ]
        text = "removed " + ", ".join(parts) + " of agents that are gone"
        if self.kept:
            text += f"; kept {', '.join(self.kept)} (a job still runs in them)"
        return text


@contextlib.contextmanager
def host_lock() -> Iterator[None]:
    """The host-wide job-network lock (not reentrant: one holder per process at a time)."""
    with open(HOST_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def me(tag: str, scope: str, job_uids: Iterable[tuple[int, int]] = ()) -> Owner:
    """This process as the owner of ``tag``.

    Raises:
        OSError: its start time cannot be read (a record without it would look dead at once
            and another agent would sweep this one's objects).
    """
    pid = os.getpid()
    ticks = procfs.start_ticks(pid)
    if ticks is None:
        raise OSError(f"cannot read the start time of pid {pid} in /proc")
    return Owner(tag, scope, pid, ticks, procfs.boot_id(), tuple(job_uids))


def read(tag: str) -> Owner | None:
    """The recorded owner of ``tag``; None without a (readable) record."""
    try:
        data = json.loads((REGISTRY_DIR / f"{tag}.json").read_text())
        return Owner(
            tag,
            str(data["scope"]),
            int(data["pid"]),
            int(data["start_ticks"]),
            str(data["boot_id"]),
            tuple((int(a), int(b)) for a, b in data.get("job_uids", ())),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def owners() -> dict[str, Owner]:
    """Every recorded owner by tag."""
    out: dict[str, Owner] = {}
    with contextlib.suppress(OSError):
        for path in REGISTRY_DIR.glob("*.json"):
            found = read(path.stem)
            if found is not None:
                out[found.tag] = found
    return out


def claim(owner: Owner, *, take_over: bool) -> None:
    """Record ``owner`` for its tag; the caller holds :func:`host_lock`. Without
    ``take_over`` a live other owner keeps the tag (what is made is then its).

    Raises:
        OSError: the record cannot be written.
    """
    current = read(owner.tag)
    if current == owner:
        return
    if current is not None and not take_over and current.alive():
        return
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    path = REGISTRY_DIR / f"{owner.tag}.json"
    tmp = path.with_name(f".{owner.tag}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(owner.to_json(), sort_keys=True) + "\n")
    os.replace(tmp, path)


def release(tag: str) -> None:
    """Forget the owner of ``tag`` if it is this process or gone (the caller removed the
    tag's objects); a live other owner's record stays."""
    current = read(tag)
    if current is None or (current.pid != os.getpid() and current.alive()):
        return
    with contextlib.suppress(FileNotFoundError):
        (REGISTRY_DIR / f"{tag}.json").unlink()


def sweep(*, ended_owners: Iterable[int] = ()) -> Swept:
    """Remove the namespaces, veths and tables of tags whose owner is gone (see the module
    doc for what is kept).

    Args:
        ended_owners: pids to count as gone although they run (the test session at its end,
            whose in-process agents have all stopped).

    Raises:
        OSError: the lock or the registry cannot be read.
    """
    ended = frozenset(ended_owners)
    out = Swept()
    with host_lock():
        gone = {tag: o for tag, o in owners().items() if not o.alive(ended)}
        if not gone:
            return out
        namespaces = {}
        with contextlib.suppress(OSError):
            for entry in NETNS_DIR.iterdir():
                m = NS_RE.fullmatch(entry.name)
                if m and m[1] in gone:
                    namespaces[entry.name] = m[1]
        links = {}  # host-side veth: the namespace it leads to
        for dev in _links():
            m = LINK_RE.fullmatch(dev)
            if m and m[1] in gone:
                links[dev] = f"gf-{m[1]}-{m[2]}"
        tables = [tag for tag in _tables() if tag in gone]
        procs = _processes() if namespaces or tables else []
        in_use = {ns for _, ns in procs}
        kept = set()
        for name in namespaces:
            with contextlib.suppress(OSError):
                if os.stat(NETNS_DIR / name).st_ino in in_use:
                    kept.add(name)
        busy = {namespaces[n] for n in kept}
        for tag, owner in gone.items():
            if owner.job_uids and any(
                lo <= uid <= hi for uid, _ in procs for lo, hi in owner.job_uids
            ):
                busy.add(tag)
                out.kept.append(f"table gpufleet_{tag} (a job uid runs)")
        for dev, ns in sorted(links.items()):
            if ns not in kept and _run(["ip", "link", "del", dev]):
                out.links.append(dev)
        for name in sorted(namespaces):
            if name in kept:
                out.kept.append(name)
            elif _run(["ip", "netns", "del", name]):
                out.namespaces.append(name)
        for tag in tables:
            if tag not in busy and _run(["nft", "delete", "table", "inet", f"gpufleet_{tag}"]):
                out.tables.append(f"gpufleet_{tag}")
        for tag in gone:
            if tag not in busy:
                with contextlib.suppress(FileNotFoundError):
                    (REGISTRY_DIR / f"{tag}.json").unlink()
    return out


def _which(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin") or name


def _run(argv: list[str]) -> bool:
    try:
        done = subprocess.run(
            [_which(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=CMD_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("job network sweep: %s: %s", " ".join(argv), exc)
        return False
    if done.returncode != 0:
        logger.warning("job network sweep: %s: %s", " ".join(argv), done.stderr.strip()[-300:])
    return done.returncode == 0


def _output(argv: list[str]) -> str:
    try:
        return subprocess.run(
            [_which(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=CMD_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _links() -> list[str]:
    """Names of the host namespace's links (``ip -o link show``: ``N: name@peer: ...``)."""
    out = []
    for line in _output(["ip", "-o", "link", "show"]).splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def _tables() -> list[str]:
    """Tags of the ``gpufleet_{tag}`` tables."""
    lines = _output(["nft", "list", "tables"]).splitlines()
    return [m[1] for line in lines if (m := TABLE_RE.fullmatch(line.strip()))]


def _processes() -> list[tuple[int, int]]:
    """``(uid, network namespace inode)`` of every live process (zombies are in no
    namespace and hold nothing; they are left out)."""
    out = []
    for name in os.listdir(procfs.PROC):
        if not name.isdigit():
            continue
        path = procfs.PROC / name
        try:
            link = os.readlink(path / "ns" / "net")  # "net:[4026532000]"; fails for zombies
            uid = os.stat(path).st_uid
        except OSError:
            continue
        if link.startswith("net:[") and link.endswith("]"):
            out.append((uid, int(link[5:-1])))
    return out
