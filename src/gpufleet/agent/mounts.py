"""The node's side of job mounts (``domain.mounts``): which host paths this agent lets a
container job mount (``gpufleet agent --allow-mount PATH``, repeatable; none by default),
checked when the attempt starts, after symlinks are resolved, and the ``/dev/shm`` size an
attempt gets.

A refused mount is the job's fault (its start fails, naming ``mounts[i].source``, and the job
uses a retry): the scheduler does not know which node allows what, so a job that needs a
dataset directory should select nodes that have it (``--selector``), as it would anyway
(the directory must exist there). docs/design/security.md, "Job mounts".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpufleet.agent.runtime.base import StartError
from gpufleet.domain.mounts import Mount, mount_problems, shm_mb, within_any


def normalize_allowed(paths: Iterable[str]) -> tuple[str, ...]:
    """``--allow-mount`` values as real, absolute paths (symlinks resolved).

    Raises:
        ValueError: a path is not absolute.
    """
    out = []
    for p in paths:
        if not p.startswith("/"):
            raise ValueError(f"--allow-mount {p!r} must be an absolute path")
        out.append(os.path.realpath(p))
    return tuple(dict.fromkeys(out))


def checked_mounts(
    mounts: Sequence[Mapping[str, Any]], allowed: Sequence[str], *, node: str = "this node"
) -> tuple[Mount, ...]:
    """The attempt's mounts, each source resolved (``realpath``) and checked against
    ``allowed`` (:func:`normalize_allowed`).

    Raises:
        StartError: (the job's fault) a source or target the shared checks refuse, a source
            that does not exist on this node, or one that is not (after symlinks) under an
            allowed path; the message names ``mounts[i].source``/``target``.
    """
    given = tuple(Mount.from_json(m) for m in mounts)
    problems = mount_problems(given)
    if problems:
        raise StartError(f"{problems[0][0]}: {problems[0][1]}")
    out = []
    for i, m in enumerate(given):
        real = os.path.realpath(m.source)
        if not within_any(real, allowed):
            allow = ", ".join(allowed) or "none"
            via = f" (resolves to {real!r})" if real != m.source else ""
            raise StartError(
                f"mounts[{i}].source {m.source!r}{via} is not under a path {node} allows"
                f" (--allow-mount: {allow})"
            )
        if not os.path.exists(real):
            raise StartError(f"mounts[{i}].source {m.source!r} does not exist on {node}")
        out.append(Mount(real, m.target, m.read_only))
    return tuple(out)


def node_memory_mb() -> int:
    """The node's RAM, MiB (0 when unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


def attempt_shm_mb(shm_size_mb: int, memory_mb: int) -> int:
    """The ``/dev/shm`` size (MiB) of an attempt (``domain.mounts.shm_mb`` on this node)."""
    return shm_mb(shm_size_mb, memory_mb, node_memory_mb())
