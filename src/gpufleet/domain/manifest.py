"""MANIFEST.json: the proof that an attempt's outputs are complete.

The agent uploads every file of an attempt first and the manifest last, under
``jobs/{job_id}/attempts/{run_id}/MANIFEST.json``. The controller accepts a completion only if
every listed object exists with the listed size and sha256 and the token is the job's current
one (seed DD8). Keys are relative to the object store's base URL; ``uri`` is informational.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_VERSION = 1

KIND_FOLDERS = {"log": "logs", "checkpoint": "checkpoints", "artifact": "artifacts"}
"""Each kind of stored file and the folder of the attempt's prefix it lives in."""

_UNSAFE = re.compile(r"[\x00-\x1f\x7f\\]")
MAX_PATH_CHARS = 1024


def path_problem(path: str) -> str | None:
    """Why ``path`` is not a normalised relative path (None when it is): empty, absolute,
    with ``.``/``..``/empty segments, a backslash, a control character, or too long."""
    if not isinstance(path, str) or not path:
        return "empty path"
    if len(path) > MAX_PATH_CHARS:
        return f"path longer than {MAX_PATH_CHARS} characters"
    if _UNSAFE.search(path):
        return f"path {path!r} has a backslash or a control character"
    if path.startswith("/"):
        return f"path {path!r} is absolute"
    if posixpath.normpath(path) != path or any(p in (".", "..") for p in path.split("/")):
        return f"path {path!r} is not normalised (., .., // or a trailing /)"
    return None


def file_problem(f: ManifestFile, attempt_prefix: str) -> str | None:
    """Why manifest entry ``f`` may not be accepted for the attempt whose objects live under
    ``attempt_prefix`` (None when it may): an unknown kind, a path that is not a normalised
    relative path, or a key other than ``{attempt_prefix}/{folder of kind}/{path}``. So a key
    can never name an object outside the attempt's prefix, whatever the store's layout."""
    folder = KIND_FOLDERS.get(f.kind)
    if folder is None:
        return f"unknown file kind {f.kind!r}"
    problem = path_problem(f.path)
    if problem is not None:
        return problem
    want = f"{attempt_prefix}/{folder}/{f.path}"
    if f.key != want:
        return f"key {f.key!r} is not {want!r} (outside the attempt's prefix or renamed)"
    return None


def _typed(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` if each field of dataclass ``cls`` in it has its declared type; else
    TypeError (a number where a name belongs must not reach string code later)."""
    kinds: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}
    for f in fields(cls):
        want = kinds.get(str(f.type))
        if want is None or f.name not in data:
            continue
        value = data[f.name]
        if isinstance(value, bool) or not isinstance(value, want):
            raise TypeError(f"{cls.__name__}.{f.name} must be {f.type}, not {value!r:.40}")
    return data


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One stored object. ``kind`` is ``log``, ``checkpoint`` or ``artifact``; ``path`` is its
    path relative to its kind's directory (e.g. ``model.npz``)."""

    kind: str
    path: str
    key: str
    uri: str
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """Attributes:
    started_at_s / finished_at_s: seconds since the epoch (agent clock, informational).
    exit_code: the process's exit status; negative = killed by that signal number.
    outcome: ``EXITED`` or ``STOPPED`` (as in ReportCompletion).
    """

    job_id: str
    run_id: str
    token: int
    outcome: str
    exit_code: int
    started_at_s: float
    finished_at_s: float
    files: tuple[ManifestFile, ...] = field(default_factory=tuple)
    stop_reason: str = ""
    version: int = MANIFEST_VERSION

    def to_json(self) -> bytes:
        data = asdict(self)
        data["files"] = [asdict(f) for f in self.files]
        return json.dumps(data, indent=2, sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes | str) -> Manifest:
        """Parse a manifest. Raises ValueError on malformed content."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise TypeError("a manifest is a JSON object")
            listed = data.pop("files", [])
            if not isinstance(listed, list) or not all(isinstance(f, dict) for f in listed):
                raise TypeError("files must be a list of objects")
            files = tuple(ManifestFile(**_typed(ManifestFile, f)) for f in listed)
            return Manifest(files=files, **_typed(Manifest, data))
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from exc

    def checkpoint_prefix(self) -> str | None:
        """Key prefix of this attempt's checkpoints, or None when it stored none."""
        for f in self.files:
            if f.kind == "checkpoint":
                return f.key[: len(f.key) - len(f.path)].rstrip("/")
        return None
