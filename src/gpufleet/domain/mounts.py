"""Host directories a container job mounts (``--mount SRC:DST[:ro]``) and the size of its
``/dev/shm`` (``--shm-size``): parsing and the checks every layer shares.

The checks here are syntactic (absolute, normalized, no reserved target); whether a host
path may be mounted at all is an admin's decision, made twice: the fleet's allow list at
submit (``GPUFLEET_ALLOWED_MOUNTS``, a 422 naming ``mounts[i].source``) and each node's
(``gpufleet agent --allow-mount PATH``) when the attempt starts (a job-caused start failure
naming the field). docs/design/security.md, "Job mounts".
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_MOUNTS = 32
"""Most mounts of one job."""

RESERVED_TARGETS = ("/proc", "/sys", "/dev")
"""Kernel filesystems: a mount on or under them is refused."""
OWN_TARGETS = ("/gpufleet", "/tmp", "/var/tmp")
"""Where the platform mounts the attempt's own directories (checkpoints, artifacts, resume,
work under ``/gpufleet``; the attempt's private tmp): a job mount on, under or over them is
refused."""

SHM_FLOOR_MB = 1024
"""The smallest default ``/dev/shm`` (MiB): podman's own default (64 MB) is too small for
PyTorch DataLoader workers, which pass batches through shared memory."""
SHM_FRACTION = 4
"""The default ``/dev/shm`` is ``memory_mb / SHM_FRACTION`` (at least :data:`SHM_FLOOR_MB`,
at most ``memory_mb``)."""
MAX_SHM_MB = 16 * 1024 * 1024
"""16 TiB: a larger ``shm_size_mb`` is a typo."""


@dataclass(frozen=True, slots=True)
class Mount:
    """One host path mounted into a container job.

    Attributes:
        source: absolute, normalized host path (a directory or a file).
        target: absolute, normalized path inside the container.
        read_only: mounted ``ro`` (always ``nosuid,nodev``).
    """

    source: str
    target: str
    read_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "read_only": self.read_only}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Mount:
        return Mount(str(data["source"]), str(data["target"]), bool(data.get("read_only")))


def parse_mount(text: str) -> Mount:
    """``SRC:DST``, ``SRC:DST:ro`` or ``SRC:DST:rw`` as a :class:`Mount` (not yet checked).

    Raises:
        ValueError: not of that form.
    """
    parts = text.split(":")
    if len(parts) == 2:
        return Mount(parts[0], parts[1])
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        return Mount(parts[0], parts[1], parts[2] == "ro")
    raise ValueError(f"mount {text[:200]!r} must be SRC:DST or SRC:DST:ro (absolute paths)")


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def within_any(path: str, directories: Iterable[str]) -> bool:
    """``path`` is one of ``directories`` or under one (normalized absolute paths)."""
    return any(_within(path, d) for d in directories)


def _path_problem(path: str) -> str | None:
    if not path.startswith("/"):
        return "must be an absolute path"
    if posixpath.normpath(path) != path or path.startswith("//"):
        return "must be a normalized path (no '.', '..', '//' or trailing '/')"
    if path == "/":
        return "must not be /"
    if any(c in path for c in ":,\n\x00"):
        return "must not hold ':', ',', newlines or NUL"
    if len(path) > 4096:
        return "is longer than 4096 characters"
    return None


def mount_problems(mounts: Sequence[Mount]) -> list[tuple[str, str]]:
    """The problems of ``mounts`` as ``(field, message)`` pairs (empty: all valid); fields
    are ``mounts[i].source`` / ``mounts[i].target`` / ``mounts``."""
    out: list[tuple[str, str]] = []
    if len(mounts) > MAX_MOUNTS:
        out.append(("mounts", f"at most {MAX_MOUNTS} mounts, not {len(mounts)}"))
    seen: set[str] = set()
    for i, m in enumerate(mounts):
        if (p := _path_problem(m.source)) is not None:
            out.append((f"mounts[{i}].source", f"source {m.source[:200]!r} {p}"))
        if (p := _path_problem(m.target)) is not None:
            out.append((f"mounts[{i}].target", f"target {m.target[:200]!r} {p}"))
            continue
        if within_any(m.target, RESERVED_TARGETS):
            out.append(
                (f"mounts[{i}].target", f"target {m.target!r} is under /proc, /sys or /dev")
            )
        elif within_any(m.target, OWN_TARGETS) or any(_within(o, m.target) for o in OWN_TARGETS):
            out.append(
                (
                    f"mounts[{i}].target",
                    f"target {m.target!r} is on, under or over the job's own mounts"
                    f" ({', '.join(OWN_TARGETS)})",
                )
            )
        elif m.target in seen:
            out.append((f"mounts[{i}].target", f"target {m.target!r} is mounted twice"))
        seen.add(m.target)
    return out


def default_shm_mb(memory_mb: int, node_memory_mb: int = 0) -> int:
    """The ``/dev/shm`` size (MiB) of an attempt that set no ``shm_size_mb``: a quarter of
    its ``memory_mb`` (the tmpfs pages count against it), at least :data:`SHM_FLOOR_MB`
    and at most ``memory_mb``; with no ``memory_mb``, a quarter of ``node_memory_mb`` (the
    node's RAM, MiB; 0 = unknown: the floor)."""
    base = memory_mb if memory_mb > 0 else node_memory_mb
    size = max(SHM_FLOOR_MB, base // SHM_FRACTION)
    return min(size, memory_mb) if memory_mb > 0 else size


def shm_mb(shm_size_mb: int, memory_mb: int, node_memory_mb: int = 0) -> int:
    """The ``/dev/shm`` size (MiB) an attempt gets: its job's ``shm_size_mb`` when set
    (> 0), else :func:`default_shm_mb`."""
    return shm_size_mb if shm_size_mb > 0 else default_shm_mb(memory_mb, node_memory_mb)
