"""Crash-safe file writes (standard library only: the shim imports this).

A rename is atomic on POSIX, so readers see the old file or the whole new one; fsync of the file
and then of its directory makes the new name survive a power loss.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename, link or unlink inside it is durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path: Path, data: bytes) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # e.g. ENOSPC: leave no half-written file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    Raises:
        OSError: the directory is not writable.
    """
    os.replace(_write_tmp(path, data), path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    """:func:`write_bytes_atomic` of ``json.dumps(data)``."""
    write_bytes_atomic(path, json.dumps(data).encode())


def create_exclusive(path: Path, data: Any) -> bool:
    """Create ``path`` holding ``data`` (JSON) atomically, only if it does not exist yet.

    The content is written to a temporary file first and hard-linked into place; ``link``
    fails if the name exists, so the file is never seen empty and exactly one of several racing
    creators wins.

    Returns:
        True if this call created it; False if another creator's file is already there.

    Raises:
        OSError: the directory is not writable.
    """
    tmp = _write_tmp(path, json.dumps(data).encode())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)
    return True
