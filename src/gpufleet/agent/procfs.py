"""Process facts from ``/proc`` (Linux): start times against pid reuse, and process groups.

Two traps shape this module:

* **pid reuse.** After an agent restart a logged pid may belong to a new, unrelated process.
  A pid is "the same process" only if ``/proc/{pid}/stat`` field 22 (start time, clock ticks
  since boot) equals the value logged when it was started.
* **pgid reuse.** Linux frees a pid number only when no process uses it as pid, process group
  or session id. So if a live process now has the pid of our (dead) group leader but another
  start time, our group was empty when that pid was handed out, and an empty group can never
  gain members again: it is gone, and signalling that pgid would hit a stranger.
* **reboots.** Start ticks restart at boot, so a logged ``(pid, start_ticks)`` is compared only
  within the same ``/proc/sys/kernel/random/boot_id``; after a reboot nothing logged is alive.
* **zombies.** ``kill(pid, 0)`` and ``killpg(pgid, 0)`` succeed on zombies. A zombie holds no
  memory, no CPU and no GPU context, but it is only removed when its parent reaps it, and an
  orphan is reaped by PID 1 — which in some containers never reaps. A group whose members
  are all zombies is therefore treated as gone.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


class ProcStat(NamedTuple):
    """The fields of ``/proc/{pid}/stat`` the agent needs.

    Attributes:
        pid: process id.
        state: one letter (``R``, ``S``, ``Z`` zombie, ``X`` dead, ...).
        pgrp: process group id.
        start_ticks: start time in clock ticks since boot.
    """

    pid: int
    state: str
    pgrp: int
    start_ticks: int


def read_stat(pid: int) -> ProcStat | None:
    """Parse ``/proc/{pid}/stat``; None if the process does not exist (or vanished mid-read)."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) is in parentheses and may contain spaces or ')': split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return ProcStat(pid=pid, state=rest[0], pgrp=int(rest[2]), start_ticks=int(rest[19]))
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    st = read_stat(pid)
    return st.start_ticks if st is not None else None


def is_same_process_alive(pid: int, expected_start_ticks: int) -> bool:
    """True if ``pid`` exists, is not a zombie, and started at ``expected_start_ticks``."""
    st = read_stat(pid)
    return st is not None and st.state not in "ZX" and st.start_ticks == expected_start_ticks


@cache
def boot_id() -> str:
    """This boot's random id ("" where unavailable). Read once per process: it cannot change
    while the process runs, and the monitor asks for it at every poll of every attempt."""
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def leader_reused(pgid: int, leader_start_ticks: int) -> bool:
    """True if a process now holds pid ``pgid`` with a start time other than our group
    leader's: our group is gone and ``pgid`` names someone else's (see module doc). An unknown
    start time (0) never counts as reuse."""
    if leader_start_ticks <= 0:
        return False
    st = read_stat(pgid)
    return st is not None and st.start_ticks != leader_start_ticks


def group_members(pgid: int) -> list[ProcStat]:
    """Live (non-zombie) processes whose process group is ``pgid``. Scans ``/proc``: call it
    only when a group is expected to be empty, not on every poll."""
    members = []
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        st = read_stat(int(entry.name))
        if st is not None and st.pgrp == pgid and st.state not in "ZX":
            members.append(st)
    return members


def group_alive(pgid: int, leader_start_ticks: int) -> bool:
    """Whether any non-zombie process is left in our process group ``pgid``.

    ``os.killpg(pgid, 0)`` raising ProcessLookupError is the proof of absence. When it succeeds
    the group may hold only zombies, or the number may have been reused (see module doc), so
    ``/proc`` decides.

    Args:
        pgid: the group, i.e. the pid of its leader (the shim).
        leader_start_ticks: the leader's start time, to detect reuse of the number.
    """
    if leader_reused(pgid, leader_start_ticks):
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return bool(group_members(pgid))


def signal_group(pgid: int, leader_start_ticks: int, sig: int) -> bool:
    """Send ``sig`` to our process group ``pgid`` (never to a group that reused the number).

    Returns:
        False if the group no longer exists.
    """
    if leader_reused(pgid, leader_start_ticks):
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
