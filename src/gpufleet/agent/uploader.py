"""Getting an attempt's outputs into the object store.

* While an attempt runs, :class:`LogStreamer` copies its log to
  ``{attempt_prefix}/logs/output.log`` about once a second (whole-file overwrite, only when the
  file changed) so users can follow it.
* When it has ended, :func:`upload_attempt` uploads the final log, every regular file under
  the checkpoint and artifact directories, and then — last — ``MANIFEST.json`` listing each
  object's key, size and sha256 (seed DD8: the manifest's existence proves the upload is
  complete). Only after that does the agent report the completion.

Only regular files are uploaded, and no symbolic link is ever followed: not a linked file,
not a linked directory, not an output directory that is itself a link (following one would
let a job publish any file the agent can read, e.g. a link to /etc/passwd in its artifacts).
Files are opened with ``O_NOFOLLOW`` relative to directory descriptors (``os.fwalk``), so a
job cannot swap a link in between the check and the read; the bytes hashed are the bytes
uploaded. Each skipped entry is logged.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from gpufleet.agent import telemetry
from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.workdir import RunPaths
from gpufleet.domain.manifest import (
    KIND_FOLDERS,
    MANIFEST_NAME,
    Manifest,
    ManifestFile,
    path_problem,
)
from gpufleet.objectstore import ObjectStore, attempt_prefix

logger = logging.getLogger("gpufleet.agent")

LOG_KEY = "logs/output.log"


def open_regular(name: str | Path, dir_fd: int | None = None) -> int | None:
    """A read-only descriptor of ``name`` if it is a regular file, else None: a symbolic link
    is not followed (``O_NOFOLLOW``), and a FIFO or device is not waited on (``O_NONBLOCK``).

    Raises:
        OSError: it cannot be opened for another reason (missing, permissions).
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


class _Hashing:
    """Reads a file object and keeps the sha256 and size of what was read."""

    def __init__(self, src: BinaryIO) -> None:
        self.src, self.sha, self.size = src, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data


def upload_fd(store: ObjectStore, fd: int, key: str) -> tuple[str, int, str]:
    """Upload the open file ``fd`` (closed afterwards) to ``key``, hashing the same bytes.
    Returns (hex sha256, size in bytes, URI)."""
    with os.fdopen(fd, "rb") as f:
        reader = _Hashing(f)
        uri = store.put_fileobj(key, reader)  # type: ignore[arg-type]
    telemetry.count_upload(reader.size)
    return reader.sha.hexdigest(), reader.size, uri


def regular_files(root: Path, what: str = "") -> Iterator[tuple[str, int]]:
    """``(relpath, open descriptor)`` of every regular file under ``root``, sorted within
    each directory; the caller closes each descriptor. Symbolic links (to files or
    directories, or ``root`` itself), FIFOs, sockets and devices are skipped and logged, and
    so are files and directories whose path no manifest may list (a control character such
    as a newline, a backslash, over 1024 characters: :func:`path_problem`; logged escaped),
    so that one odd name cannot fail the whole attempt's manifest."""
    label = what or str(root)
    try:
        if stat.S_ISLNK(os.lstat(root).st_mode):
            logger.warning("%s: skipped, it is a symbolic link (not followed)", label)
            return
    except FileNotFoundError:
        return
    if not root.is_dir():
        return
    walk = os.fwalk(root, follow_symlinks=False, onerror=_vanished(label))
    for dirpath, dirnames, filenames, dirfd in walk:
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        for name in list(dirnames):  # links to directories are listed here and never entered
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if _unlistable(label, rel, "directory"):
                dirnames.remove(name)  # top-down walk: not entered
                continue
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                if stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode):
                    logger.warning("%s/%s: skipped, a symbolic link (not followed)", label, rel)
        for name in sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if _unlistable(label, rel, "file"):
                continue
            try:
                fd = open_regular(name, dir_fd=dirfd)
            except OSError as exc:
                logger.warning("%s/%s: skipped, cannot be read: %s", label, rel, exc.strerror)
                continue
            if fd is None:
                try:
                    kind = os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                why = "a symbolic link (not followed)" if stat.S_ISLNK(kind) else "not a file"
                logger.warning("%s/%s: skipped, %s", label, rel, why)
                continue
            yield rel, fd


def _unlistable(label: str, rel: str, what: str) -> bool:
    """Whether ``rel`` is a path no manifest may list (the controller would refuse the whole
    manifest); if so it is logged, escaped (``%r``: a newline shows as ``\\n``)."""
    problem = path_problem(rel)
    if problem is None:
        return False
    logger.warning(
        "%s: %s %.300r skipped, no manifest may list it: %.400s", label, what, rel, problem
    )
    return True


def _vanished(label: str) -> Callable[[OSError], None]:
    """``os.fwalk``'s error handler: a directory removed while walked is skipped (a full
    disk's files removed by hand); other errors are raised (the upload is retried)."""

    def onerror(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc
        logger.warning("%s: %s vanished while uploading; skipped", label, exc.filename)

    return onerror


def upload_attempt(store: ObjectStore, rec: RunRecord, paths: RunPaths) -> str:
    """Upload an ended attempt's log, checkpoints and artifacts, then its manifest (last).

    Idempotent: a retry after a crash overwrites the same keys.

    Args:
        store: the object store.
        rec: the attempt; ``outcome`` (EXITED or STOPPED), ``exit_code``, times and
            ``stop_reason`` go into the manifest.
        paths: its local directories.

    Returns:
        The manifest's URI.

    Raises:
        OSError: a read or an upload failed; retry later.
    """
    prefix = attempt_prefix(rec.job_id, rec.run_id)
    files: list[ManifestFile] = []

    def put(kind: str, rel: str, fd: int) -> None:
        key = f"{prefix}/{KIND_FOLDERS[kind]}/{rel}"
        digest, size, uri = upload_fd(store, fd, key)
        files.append(ManifestFile(kind=kind, path=rel, key=key, uri=uri, sha256=digest, size=size))

    try:
        log_fd = open_regular(paths.log)
    except FileNotFoundError:
        log_fd = None
        _mirrored_log(store, rec, f"{prefix}/{LOG_KEY}", files)
    if log_fd is not None:
        put("log", "output.log", log_fd)
    elif paths.log.is_symlink():
        logger.warning("run %s: output.log skipped, a symbolic link", rec.run_id)
    for kind, root in (("checkpoint", paths.checkpoints), ("artifact", paths.artifacts)):
        for rel, fd in regular_files(root, f"run {rec.run_id}: {root.name}"):
            put(kind, rel, fd)
    manifest = Manifest(
        job_id=rec.job_id,
        run_id=rec.run_id,
        token=rec.token,
        outcome=rec.outcome,
        exit_code=rec.exit_code,
        started_at_s=rec.started_at_s,
        finished_at_s=rec.finished_at_s,
        files=tuple(files),
        stop_reason=rec.stop_reason,
    )
    body = manifest.to_json()
    uri = store.put_bytes(f"{prefix}/{MANIFEST_NAME}", body)
    telemetry.count_upload(len(body))
    return uri


def _mirrored_log(store: ObjectStore, rec: RunRecord, key: str, files: list[ManifestFile]) -> None:
    """The local log is gone (removed to free a full disk, or never written): the copy
    :class:`LogStreamer` mirrored while the attempt ran, if any, is listed instead (it may
    lack the last second of output)."""
    try:
        if not store.exists(key):
            logger.warning("run %s: no local log and none mirrored: no log", rec.run_id)
            return
        size, digest = store.size(key), store.sha256(key)
    except OSError as exc:  # retried with the whole upload
        raise OSError(f"the mirrored log {key} cannot be read: {exc}") from exc
    logger.warning("run %s: local log gone; the manifest lists its mirrored copy", rec.run_id)
    uri = store.uri(key)
    files.append(
        ManifestFile(kind="log", path="output.log", key=key, uri=uri, sha256=digest, size=size)
    )


class LogStreamer:
    """A thread that mirrors live attempts' logs to the object store.

    Args:
        store: the object store.
        interval_s: seconds between passes.
        stop_event: ends the thread.
    """

    def __init__(self, store: ObjectStore, interval_s: float, stop_event: threading.Event) -> None:
        self.store = store
        self.interval_s = interval_s
        self.stop_event = stop_event
        self._cond = threading.Condition()
        self._watched: dict[str, tuple[Path, str]] = {}
        self._last: dict[str, tuple[int, int]] = {}
        self._uploading: str | None = None
        self.thread = threading.Thread(target=self._loop, name="agent-logs", daemon=True)

    def watch(self, rec: RunRecord, log_path: Path) -> None:
        """Start mirroring ``log_path`` of attempt ``rec``."""
        key = f"{attempt_prefix(rec.job_id, rec.run_id)}/{LOG_KEY}"
        with self._cond:
            self._watched[rec.run_id] = (log_path, key)

    def forget(self, run_id: str) -> None:
        """Stop mirroring; returns once no upload of this attempt's log is in flight, so the
        final upload cannot race a stale partial one."""
        with self._cond:
            self._watched.pop(run_id, None)
            self._last.pop(run_id, None)
            while self._uploading == run_id:
                self._cond.wait()

    def _loop(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            self.sync_once()

    def sync_once(self) -> None:
        """One pass: upload each watched log whose size or mtime changed."""
        with self._cond:
            items = list(self._watched.items())
        for run_id, (path, key) in items:
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            sig = (st.st_size, st.st_mtime_ns)
            with self._cond:
                if run_id not in self._watched or self._last.get(run_id) == sig:
                    continue
                self._uploading = run_id
            try:
                fd = open_regular(path)
                if fd is not None:  # a log replaced by a symbolic link is never followed
                    upload_fd(self.store, fd, key)
                with self._cond:
                    if run_id in self._watched:
                        self._last[run_id] = sig
            except Exception as exc:  # any backend error: retried on the next pass
                logger.warning("run %s: log upload failed: %s", run_id, exc)
            finally:
                with self._cond:
                    self._uploading = None
                    self._cond.notify_all()
