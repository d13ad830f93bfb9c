"""One ``gpufleet up`` (or ``gpufleet demo``) per data directory: ``{data_dir}/up.lock``.

The file is locked with ``flock`` for the life of the ``gpufleet up`` process and holds one
JSON object, ``{"pid": N, "url": "http://...", "by": "gpufleet up"}`` (the URL once the API
listens; ``by`` names the command). ``gpufleet demo`` takes the same lock on its own data dir
(``{data_dir}/demo``) before it empties it, so a second demo refuses instead of deleting the
files of one still running. The kernel
drops the lock when the process ends however it ends (``kill -9`` included), so a file left
behind by a dead ``up`` is stale and simply taken over; the pid in it is only for the message.
The descriptor is not inherited by the processes ``up`` starts (Python's default), so an agent
that outlives ``up`` does not keep the directory locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Any

LOCK_NAME = "up.lock"


class DataDirInUse(Exception):
    """Another live ``gpufleet up`` (or demo) holds the data directory; ``str()`` is the
    one-line message: ``data dir DIR is in use by gpufleet up (pid N) at URL``; ``pid`` is
    the holder's pid (``"?"`` when unknown)."""

    def __init__(self, message: str, pid: object = "?") -> None:
        super().__init__(message)
        self.pid = pid


class UpLock:
    """The held lock (keep the object alive as long as ``up`` runs; :meth:`release` ends it)."""

    def __init__(self, path: Path, fd: int, by: str = "gpufleet up") -> None:
        self.path, self._fd, self.by = path, fd, by

    def set_url(self, url: str) -> None:
        """Record the API's URL next to the pid (read by a second ``up``'s message)."""
        self._write({"pid": os.getpid(), "url": url, "by": self.by})

    def _write(self, data: dict[str, Any]) -> None:
        raw = (json.dumps(data) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, raw, 0)

    def release(self) -> None:
        """Unlock and close (the file stays: a later ``up`` takes it over)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def claim(data_dir: Path, by: str = "gpufleet up") -> UpLock:
    """Lock ``data_dir`` for this ``gpufleet up`` (created if missing); ``by`` names the
    command in a refused second one's message.

    Raises:
        DataDirInUse: a live ``gpufleet up`` holds it (the message names its pid and URL).
        OSError: the lock file cannot be created or opened.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        pid = holder.get("pid", "?")
        url = holder.get("url") or "(starting)"
        who = holder.get("by") or "gpufleet up"
        raise DataDirInUse(
            f"data dir {data_dir} is in use by {who} (pid {pid}) at {url}", pid
        ) from None
    except BaseException:
        os.close(fd)
        raise
    lock = UpLock(path, fd, by)
    lock._write({"pid": os.getpid(), "url": None, "by": by})
    return lock


def _read(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def holder(data_dir: Path) -> dict[str, Any] | None:
    """The live ``gpufleet up`` (or demo) holding ``data_dir``: its lock file's JSON
    (``pid``, ``url``, ``by``); None when no process holds the lock (no file, or a stale one
    left by an ``up`` that ended)."""
    path = data_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)  # we got it: nobody holds it
        return None
    finally:
        os.close(fd)
