"""The object store: logs, checkpoints, artifacts and manifests of attempts.

One interface over fsspec: a local directory by default (``file:///...``), any fsspec URL
(e.g. ``s3://bucket/prefix`` with s3fs installed) in production. Objects of an attempt live
under ``jobs/{job_id}/attempts/{run_id}/``. A local store uses the standard library
(:class:`_LocalFiles`) and imports no fsspec: ~3.5 MB less in a node agent's memory.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

PROBE_PREFIX = "_gpufleet/probe"
"""Reserved key prefix (no job's objects live there): each agent writes and reads back
``{PROBE_PREFIX}/{node_id}`` before it registers (:func:`probe`), a random nonce that its
RegisterNode carries; the controller reads it from its own store (:class:`ProbeReader`)."""


def public_url(url: str) -> str:
    """``url`` normalised and without credentials, for comparing two processes' stores and
    for messages: a bare path becomes ``file:///abs/path`` (``..``, ``//`` and a trailing
    ``/`` removed; symbolic links are not resolved); other URLs lose ``user:password@``,
    the query and fragment (where fsspec URLs may carry keys), and a trailing ``/``; the
    scheme and host are lower-cased. ``s3://bucket/prefix`` stays as it is."""
    if "://" not in url:
        url = "file://" + str(Path(url).expanduser().absolute())
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        return "file://" + os.path.normpath("/" + rest.lstrip("/"))
    rest = rest.split("#", 1)[0].split("?", 1)[0]
    host, _, path = rest.partition("/")
    host = host.rsplit("@", 1)[-1].lower()
    path = "/".join(p for p in path.split("/") if p)
    return f"{scheme}://{host}/{path}" if path else f"{scheme}://{host}"


def same_store(a: str, b: str) -> bool:
    """Whether URLs ``a`` and ``b`` name the same object store (:func:`public_url` equal; a
    local directory is the same only at the same path, meaningful on one machine only)."""
    return public_url(a) == public_url(b)


def mismatch(agent_url: str, fleet_url: str) -> str | None:
    """One line naming both stores when an agent's store is not the fleet's, else None
    (also None when either is empty: a process older than the check says nothing)."""
    if not agent_url or not fleet_url or same_store(agent_url, fleet_url):
        return None
    return (
        f"object store mismatch: this agent uses {public_url(agent_url)}, the fleet uses "
        f"{public_url(fleet_url)} (set GPUFLEET_OBJECT_STORE_URL and the store's credentials "
        "on the agent as on the controllers and API servers)"
    )


def probe_key(node_id: str) -> str:
    """The reserved key of ``node_id``'s probe object, e.g. ``_gpufleet/probe/gpu-17``."""
    return f"{PROBE_PREFIX}/{node_id or 'node'}"


def new_probe_nonce() -> str:
    """A fresh random nonce for a probe object: 32 hex characters (128 bits)."""
    return secrets.token_hex(16)


def probe(url: str, node_id: str, nonce: str | None = None) -> str | None:
    """Write ``nonce`` (ASCII; a fresh random one when None) as the object at
    :func:`probe_key` of store ``url`` and read it back: None when it came back intact, else
    a one-line reason (the exception's type and message: a missing s3fs, a directory that
    cannot be created, refused credentials, an unreachable endpoint). Blocks for as long as
    the backend's own retries take. The controller reads the same key from its own store
    (:class:`ProbeReader`) to prove both processes use one store, not only one URL."""
    key = probe_key(node_id)
    data = (nonce or new_probe_nonce()).encode()
    try:
        store = ObjectStore(url)
        store.put_bytes(key, data)
        back = store.get_bytes(key)
    except ImportError as exc:  # fsspec's message names the package to install
        hint = " (pip install 'gpufleet[s3]')" if url.lower().startswith("s3") else ""
        return f"{exc}".splitlines()[0] + hint
    except Exception as exc:  # any backend's error: the agent must not register
        return _one_line(exc)
    if back != data:
        return f"the probe object {key} read back other bytes than were written"
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "no message"
    return f"{type(exc).__name__}: {text}"[:500]


class ProbeVerdict(enum.Enum):
    SAME = "same"
    """The probe object holds the agent's nonce: one store."""
    OTHER = "other"
    """Missing, or another nonce: the agent wrote to another store (refuse the node)."""
    UNKNOWN = "unknown"
    """The controller could not read its own store in time (its outage, not the agent's)."""


@dataclass(frozen=True, slots=True)
class ProbeCheck:
    verdict: ProbeVerdict
    detail: str
    """One line: the refusal (OTHER) or the controller's own error (UNKNOWN); '' for SAME."""


PROBE_READ_LIMIT = 4096
"""Bytes of a probe object read at most (a nonce is 32)."""


class ProbeReader:
    """Reads agents' probe objects from this process's store, each read bounded in time.

    Each read runs on a daemon thread of its own (a hung read never holds the process at
    exit); at most ``workers`` run at once, so a store that hangs holds at most that many
    threads, and a caller waits ``timeout_s`` at most in all (for a free slot and the read).

    Args:
        store: the controller's own object store.
        timeout_s: seconds, float, that :meth:`check` waits at most.
        workers: reads at once.
    """

    def __init__(self, store: ObjectStore, *, timeout_s: float = 6.0, workers: int = 4) -> None:
        self.store, self.timeout_s = store, timeout_s
        self._slots = threading.BoundedSemaphore(workers)
        # the first read of a store pays for its client's start (s3fs: botocore's session and
        # connection, seconds on a loaded host): pay it now, not in an agent's registration
        threading.Thread(target=self._warm, name="store-probe-warm", daemon=True).start()

    def _warm(self) -> None:
        with contextlib.suppress(Exception):
            self.store.get_bytes(probe_key("-warm-up-"), 0, 1)

    def _read(self, key: str, box: list[bytes | BaseException], done: threading.Event) -> None:
        try:
            invalidate = getattr(self.store.fs, "invalidate_cache", None)
            if invalidate is not None:  # s3fs may answer "absent" from a cached listing
                invalidate(self.store._path(key))
            box.append(self.store.get_bytes(key, 0, PROBE_READ_LIMIT))
        except BaseException as exc:  # handed to the caller
            box.append(exc)
        finally:
            self._slots.release()
            done.set()

    def check(self, node_id: str, nonce: str) -> ProbeCheck:
        """Whether :func:`probe_key` of ``node_id`` in this store holds ``nonce``. Never
        raises: a missing object or another content is OTHER (with the line the agent
        exits with); any other error, or no answer within ``timeout_s``, is UNKNOWN."""
        key = probe_key(node_id)
        uri = self.store.uri(key)
        where = public_url(self.store.base_url) + "/" + key
        deadline = time.monotonic() + self.timeout_s
        late = ProbeCheck(ProbeVerdict.UNKNOWN, f"reading {uri} took over {self.timeout_s:g} s")
        if not self._slots.acquire(timeout=self.timeout_s):
            return late  # every slot held by a read that hangs
        box: list[bytes | BaseException] = []
        done = threading.Event()
        threading.Thread(
            target=self._read, args=(key, box, done), name="store-probe", daemon=True
        ).start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            return late
        got = box[0]
        if isinstance(got, FileNotFoundError):
            return ProbeCheck(
                ProbeVerdict.OTHER,
                f"the controller cannot read this agent's probe object at {where}: {_SPLIT}",
            )
        if isinstance(got, BaseException):  # the controller's own store trouble
            return ProbeCheck(ProbeVerdict.UNKNOWN, f"reading {uri}: {_one_line(got)}")
        if got != nonce.encode():
            return ProbeCheck(
                ProbeVerdict.OTHER,
                "the controller reads another nonce than this agent wrote in its probe "
                f"object at {where}: {_SPLIT}",
            )
        return ProbeCheck(ProbeVerdict.SAME, "")


_SPLIT = (
    "the agent and the controller use different object stores (check AWS_ENDPOINT_URL / "
    "credentials)"
)


def attempt_prefix(job_id: str, run_id: str) -> str:
    """Key prefix of one attempt, e.g. ``jobs/j-1/attempts/r-1``."""
    return f"jobs/{job_id}/attempts/{run_id}"


class _LocalFiles:
    """The filesystem calls :class:`ObjectStore` makes, on local paths, with the standard
    library (what fsspec's ``LocalFileSystem`` does for them)."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def put_file(self, src: str, dst: str) -> None:
        shutil.copyfile(src, dst)

    def get_file(self, src: str, dst: str) -> None:
        shutil.copyfile(src, dst)

    def mv(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def open(self, path: str, mode: str = "rb") -> IO[Any]:
        return open(path, mode)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def find(self, root: str) -> list[str]:
        """Files under ``root`` (recursive; ``[root]`` for a file), normalised paths."""
        if os.path.isfile(root):
            return [os.path.normpath(root)]
        return [
            os.path.normpath(os.path.join(top, name))
            for top, _dirs, files in os.walk(root)
            for name in files
        ]


class ObjectStore:
    """Put and get objects by key under a base URL.

    Args:
        base_url: ``file:///abs/dir`` or a bare path (local), or any fsspec URL.
    """

    def __init__(self, base_url: str) -> None:
        if "://" not in base_url:
            base_url = "file://" + str(Path(base_url).expanduser().resolve())
        self.base_url = base_url.rstrip("/")
        self._protocol = self.base_url.split("://", 1)[0]
        local = self.base_url[len("file://") :] if self._protocol == "file" else ""
        self.fs: Any
        if local.startswith("/"):
            self.fs, self._root = _LocalFiles(), os.path.normpath(local)
        else:
            import fsspec

            # a filesystem of its own: fsspec's instance cache keys on the URL and arguments,
            # not on the environment s3fs reads its endpoint and credentials from
            # (AWS_ENDPOINT_URL, AWS_*), so a cached one could talk to another server
            self.fs, self._root = fsspec.core.url_to_fs(self.base_url, skip_instance_cache=True)
        if self._protocol == "file":
            Path(self._root).mkdir(parents=True, exist_ok=True)

    def uri(self, key: str) -> str:
        """Full URI of ``key`` (what manifests and the API show)."""
        return f"{self.base_url}/{key.lstrip('/')}"

    def key_of(self, uri: str) -> str:
        """Inverse of :meth:`uri`. Raises ValueError for a URI outside this store."""
        if not uri.startswith(self.base_url + "/"):
            raise ValueError(f"{uri!r} is not in object store {self.base_url!r}")
        return uri[len(self.base_url) + 1 :]

    def _path(self, key: str) -> str:
        return f"{self._root}/{key.lstrip('/')}"

    def put_file(self, local_path: str | Path, key: str) -> str:
        """Upload a local file; returns its URI. Writes to a temporary name then renames where
        the backend allows, so readers never see half a file."""
        path = self._path(key)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if self._protocol == "file":
            tmp = path + ".part"
            self.fs.put_file(str(local_path), tmp)
            self.fs.mv(tmp, path)
        else:
            self.fs.put_file(str(local_path), path)
        return self.uri(key)

    def put_fileobj(self, key: str, src: BinaryIO, chunk_bytes: int = 1 << 20) -> str:
        """Upload from an open binary file (read in chunks, to its end); returns the URI.
        Local stores write a temporary name and rename, like :meth:`put_file`."""
        path = self._path(key)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = path + ".part" if self._protocol == "file" else path
        with self.fs.open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, chunk_bytes)
        if tmp != path:
            self.fs.mv(tmp, path)
        return self.uri(key)

    def put_bytes(self, key: str, data: bytes) -> str:
        path = self._path(key)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = path + ".part" if self._protocol == "file" else path
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        if tmp != path:
            self.fs.mv(tmp, path)
        return self.uri(key)

    def get_bytes(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Read ``key`` (bytes ``[start, end)``; empty when ``start`` is at or past its end,
        however large). Raises FileNotFoundError if absent, ValueError for a negative start."""
        with self.fs.open(self._path(key), "rb") as f:
            _seek_within(f, start)
            return bytes(f.read() if end is None else f.read(max(0, end - start)))

    def iter_range(
        self, key: str, start: int = 0, end: int | None = None, chunk_bytes: int = 1 << 16
    ) -> Iterator[bytes]:
        """Yield bytes ``[start, end)`` of ``key`` (to its end when ``end`` is None) in chunks
        of at most ``chunk_bytes``: never the whole object in memory. An object replaced while
        it is read (a log re-uploaded) is read as it was when opened.

        A ``start`` at or past the end (however large) yields nothing.

        Raises:
            FileNotFoundError: no such object (on the first ``next``).
            ValueError: a negative ``start``.
        """
        with self.fs.open(self._path(key), "rb") as f:
            _seek_within(f, start)
            pos = start
            while end is None or pos < end:
                want = chunk_bytes if end is None else min(chunk_bytes, end - pos)
                chunk = f.read(want)
                if not chunk:
                    return
                pos += len(chunk)
                yield bytes(chunk)

    def tail_start(self, key: str, lines: int, block_bytes: int = 1 << 16) -> int:
        """Byte offset where the last ``lines`` lines of ``key`` begin, found by reading
        backwards from the end in blocks of ``block_bytes`` (0 when it has fewer lines; a
        final newline ends the last line, it does not start another).

        Raises:
            FileNotFoundError: no such object.
        """
        with self.fs.open(self._path(key), "rb") as f:
            size = int(f.seek(0, 2))
            if lines <= 0 or size == 0:
                return size
            f.seek(size - 1)
            needed = lines + (1 if f.read(1) == b"\n" else 0)
            found, pos = 0, size
            while pos > 0:
                n = min(block_bytes, pos)
                pos -= n
                f.seek(pos)
                buf: bytes = f.read(n)
                i: int = len(buf)
                while (i := buf.rfind(b"\n", 0, i)) >= 0:
                    found += 1
                    if found == needed:
                        return pos + i + 1
            return 0

    def get_file(self, key: str, local_path: str | Path) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._path(key), str(local_path))

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def size(self, key: str) -> int:
        return int(self.fs.size(self._path(key)))

    def sha256(self, key: str) -> str:
        """Hex sha256 of the stored object, streamed."""
        h = hashlib.sha256()
        with self.fs.open(self._path(key), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix`` (recursive), sorted."""
        root = self._path(prefix)
        if not self.fs.exists(root):
            return iter(())
        found = self.fs.find(root)
        base = self._root.rstrip("/") + "/"
        return iter(sorted(p[len(base) :] for p in found if not p.endswith(".part")))


def _seek_within(f: BinaryIO, start: int) -> None:
    """Seek ``f`` to ``start``, or to its end when ``start`` is past it (a huge offset is not an
    OverflowError/ValueError from the file object: it simply reads nothing)."""
    if start < 0:
        raise ValueError(f"negative start {start}")
    size = int(f.seek(0, 2))
    f.seek(min(start, size))
