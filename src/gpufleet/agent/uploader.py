"""Getting an attempt's outputs into the object store.

* While an attempt runs, :class:`LogStreamer` copies its log to
  ``{attempt_prefix}/logs/output.log`` about once a second (whole-file overwrite, only when the
  file changed) so users can follow it.
* When it has ended, :func:`upload_attempt` uploads the final log, every regular file under
  the checkpoint and artifact directories, and then — last — ``MANIFEST.json`` listing each
  object's key, size and sha256 (seed DD8: the manifest's existence proves the upload is
  complete). Only after that does the agent report the completion.

Symlinks in the output directories are skipped: following them would let a job publish any
file the agent can read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.workdir import RunPaths
from gpufleet.domain.manifest import MANIFEST_NAME, Manifest, ManifestFile
from gpufleet.objectstore import ObjectStore, attempt_prefix

logger = logging.getLogger("gpufleet.agent")

LOG_KEY = "logs/output.log"


def sha256_file(path: Path) -> tuple[str, int]:
    """Hex sha256 and size in bytes of a local file, streamed in 1 MiB chunks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def regular_files(root: Path) -> Iterator[tuple[Path, str]]:
    """``(path, relpath)`` of every regular file under ``root``, sorted, symlinks skipped."""
    if not root.is_dir():
        return
    found = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            p = Path(dirpath) / name
            if stat.S_ISREG(p.lstat().st_mode):
                found.append((p, p.relative_to(root).as_posix()))
    yield from sorted(found, key=lambda item: item[1])


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
    uploads: list[tuple[str, Path, str]] = []
    if paths.log.is_file():
        uploads.append(("log", paths.log, "output.log"))
    uploads += [("checkpoint", p, rel) for p, rel in regular_files(paths.checkpoints)]
    uploads += [("artifact", p, rel) for p, rel in regular_files(paths.artifacts)]
    folder = {"log": "logs", "checkpoint": "checkpoints", "artifact": "artifacts"}
    files = []
    for kind, path, rel in uploads:
        key = f"{prefix}/{folder[kind]}/{rel}"
        digest, size = sha256_file(path)
        uri = store.put_file(path, key)
        files.append(ManifestFile(kind=kind, path=rel, key=key, uri=uri, sha256=digest, size=size))
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
    return store.put_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.to_json())


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
                st = path.stat()
            except FileNotFoundError:
                continue
            sig = (st.st_size, st.st_mtime_ns)
            with self._cond:
                if run_id not in self._watched or self._last.get(run_id) == sig:
                    continue
                self._uploading = run_id
            try:
                self.store.put_file(path, key)
                with self._cond:
                    if run_id in self._watched:
                        self._last[run_id] = sig
            except Exception as exc:  # any backend error: retried on the next pass
                logger.warning("run %s: log upload failed: %s", run_id, exc)
            finally:
                with self._cond:
                    self._uploading = None
                    self._cond.notify_all()
