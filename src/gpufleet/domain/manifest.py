"""MANIFEST.json: the proof that an attempt's outputs are complete.

The agent uploads every file of an attempt first and the manifest last, under
``jobs/{job_id}/attempts/{run_id}/MANIFEST.json``. The controller accepts a completion only if
every listed object exists with the listed size and sha256 and the token is the job's current
one (seed DD8). Keys are relative to the object store's base URL; ``uri`` is informational.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_VERSION = 1


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
            data: dict[str, Any] = json.loads(raw)
            files = tuple(ManifestFile(**f) for f in data.pop("files", []))
            return Manifest(files=files, **data)
        except (TypeError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from exc

    def checkpoint_prefix(self) -> str | None:
        """Key prefix of this attempt's checkpoints, or None when it stored none."""
        for f in self.files:
            if f.kind == "checkpoint":
                return f.key[: len(f.key) - len(f.path)].rstrip("/")
        return None
