"""A finished job's artifacts, as its accepted manifest lists them (seed DD8).

Only the manifest the controller accepted (``jobs.result_uri``, set when an attempt succeeded
and every listed object matched its size and sha256) is trusted; a path is served only if that
manifest lists it, and the object key comes from the manifest entry, never from the request,
so no request path can reach an object outside the attempt.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, NotFound
from gpufleet.domain.manifest import Manifest, ManifestFile, file_problem
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.services import jobctl, jobs

log = logging.getLogger("gpufleet.artifacts")
CHUNK_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class AcceptedManifest:
    """Where a job's accepted manifest is: ``job_id``, the attempt ``run_id`` and its key."""

    job_id: str
    run_id: str
    key: str


def accepted_manifest(
    session: Session, store: ObjectStore, team_id: str | None, job_id: str
) -> AcceptedManifest:
    """The job's accepted manifest (``team_id`` None: any team's job). ``job_id`` is any job
    reference: a full id, a unique id prefix or a job name (:func:`jobctl.resolve_job_ref`).

    Raises:
        NotFound: no such job (or another team's).
        ValidationFailed: an ambiguous reference (422, field ``job_id``).
        Conflict: the job has no accepted manifest (it has not succeeded), field ``job_id``.
    """
    job_id = jobctl.resolve_job_ref(session, team_id, job_id)
    job, _runs = jobs.get_job(session, team_id, job_id)
    if not job.result_uri:
        raise Conflict(
            f"job {job_id} has no accepted manifest: it is {job.status}; artifacts are kept"
            " from the attempt that succeeded",
            field="job_id",
        )
    key = store.key_of(job.result_uri)
    run_id = key.split("/")[3] if key.count("/") >= 4 else ""
    return AcceptedManifest(job.id, run_id, key)


def read_manifest(store: ObjectStore, where: AcceptedManifest) -> Manifest:
    """Parse the manifest (object-store I/O: call outside any transaction).

    Raises:
        Conflict: it cannot be read any more (the object store lost it).
    """
    try:
        return Manifest.from_json(store.get_bytes(where.key))
    except (OSError, ValueError) as exc:
        raise Conflict(
            f"the manifest of job {where.job_id} cannot be read: {exc}", field="job_id"
        ) from None


def artifact_files(manifest: Manifest) -> list[ManifestFile]:
    """The manifest's ``artifact`` entries, by path."""
    return sorted((f for f in manifest.files if f.kind == "artifact"), key=lambda f: f.path)


def find_artifact(manifest: Manifest, where: AcceptedManifest, path: str) -> ManifestFile:
    """The manifest entry of artifact ``path`` (an exact match of a listed path).

    Raises:
        NotFound: the manifest lists no artifact ``path`` (field ``path``).
    """
    for f in manifest.files:
        # verified at acceptance; checked again so that no key outside the attempt's prefix
        # is ever read, whatever happened to the manifest since
        if (
            f.kind == "artifact"
            and f.path == path
            and file_problem(f, attempt_prefix(where.job_id, where.run_id)) is None
        ):
            return f
    raise NotFound(f"job {where.job_id} has no artifact {path!r}", field="path")


_NOT_PLAIN = re.compile(r'[^\x20-\x7e]|["\\%]')


def download_headers(f: ManifestFile) -> dict[str, str]:
    """The answer headers of artifact ``f``'s download: ``Content-Length`` (bytes),
    ``X-Gpufleet-Sha256`` and ``Content-Disposition`` (:func:`content_disposition`). One
    helper for the REST and the dashboard routes."""
    return {
        "Content-Length": str(f.size),
        "X-Gpufleet-Sha256": f.sha256,
        "Content-Disposition": content_disposition(f.path),
    }


def content_disposition(path: str) -> str:
    """``attachment`` with the last segment of ``path`` as its file name (RFC 6266): a plain
    printable-ASCII name as ``filename="name"``; any other (non-ASCII, a quote, a backslash,
    a percent sign) as an ASCII fallback ``filename="..."`` (each such character ``_``)
    plus ``filename*=UTF-8''<percent-encoded UTF-8>`` (RFC 5987). The value is always
    ASCII, so any name a manifest may hold can be sent as a header."""
    name = path.rsplit("/", 1)[-1]
    fallback = _NOT_PLAIN.sub("_", name)
    if fallback == name:
        return f'attachment; filename="{name}"'
    try:  # a name from a non-UTF-8 file system holds surrogate escapes of its bytes
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "replace")
    encoded = quote(raw, safe="")
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{encoded}"


def stream_verified(store: ObjectStore, f: ManifestFile) -> Iterator[bytes]:
    """The object's bytes in chunks, hashed on the way: the last chunk is held back until
    the size and sha256 match the manifest, so a corrupted or changed object never arrives
    complete (the answer ends short of its Content-Length and the client sees an error).
    A sync iterator: Starlette reads it in a worker thread."""
    h = hashlib.sha256()
    size = 0
    held: bytes | None = None
    try:
        for chunk in store.iter_range(f.key, 0, None, chunk_bytes=CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
            if held is not None:
                yield held
            held = chunk
    except (FileNotFoundError, OSError) as exc:
        log.error("artifact %s unreadable: %s", f.key, exc)
        return
    if size != f.size or h.hexdigest() != f.sha256:
        log.error(
            "artifact %s does not match its manifest (size %d, want %d; sha256 %s, want %s):"
            " answer cut short",
            f.key,
            size,
            f.size,
            h.hexdigest(),
            f.sha256,
        )
        return
    if held is not None:
        yield held
