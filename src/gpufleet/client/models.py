"""What the SDK returns: frozen dataclasses over the REST API's JSON.

Each keeps the whole answer in ``raw`` (fields a newer server adds are there before this SDK
names them). Times are ISO-8601 UTC strings as the server sends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from gpufleet.client.states import TERMINAL_STATES

__all__ = ["TERMINAL_STATES"]  # and the dataclasses below


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a job on one node (a JobRun)."""

    run_id: str
    attempt: int
    status: str
    node_id: str | None
    gpu_ids: tuple[int, ...]
    exit_code: int | None
    started_at: str | None
    finished_at: str | None
    message: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    processes_unverified: str | None = None
    """Set while this (fenced) attempt's processes may still run: its node's agent has not
    reported them gone yet (``"processes not verified gone: node n1 unreachable ..."``)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Attempt:
        return cls(
            run_id=str(d.get("run_id")),
            attempt=int(d.get("attempt") or 0),
            status=str(d.get("status")),
            node_id=_str(d.get("node_id")),
            gpu_ids=tuple(d.get("gpu_ids") or ()),
            exit_code=d.get("exit_code"),
            started_at=_str(d.get("started_at")),
            finished_at=_str(d.get("finished_at")),
            message=_str(d.get("message")),
            raw=d,
            processes_unverified=_str(d.get("processes_unverified")),
        )


@dataclass(frozen=True, slots=True)
class StartEstimate:
    """A waiting job's estimated start: ``earliest_at``/``latest_at`` (ISO-8601 UTC, the
    p10..p90 range; None when unknown), ``ahead`` (jobs expected to start before it on its
    GPU type), ``basis`` (what the range rests on), ``unknown`` (why there is no range),
    ``reserved`` (a backfill reservation holds GPUs for it) and ``text`` (one line as of the
    read, e.g. ``in 20-45 min; 3 jobs ahead, running work bounded by time limits``)."""

    earliest_at: str | None
    latest_at: str | None
    ahead: int
    basis: str
    unknown: str | None
    reserved: bool
    text: str

    @property
    def bounded(self) -> bool:
        """True when there is a range (``unknown`` is None)."""
        return self.unknown is None and self.latest_at is not None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StartEstimate:
        return cls(
            earliest_at=_str(d.get("earliest_at")),
            latest_at=_str(d.get("latest_at")),
            ahead=int(d.get("ahead") or 0),
            basis=str(d.get("basis") or ""),
            unknown=_str(d.get("unknown")),
            reserved=bool(d.get("reserved")),
            text=str(d.get("text") or ""),
        )


@dataclass(frozen=True, slots=True)
class PendingReason:
    """Why a job waits: a stable ``code``, a sentence, details, queue position (1 = next) and
    the estimated start (ISO-8601 UTC) when the server can give one."""

    code: str
    message: str
    details: dict[str, Any]
    position: int | None
    estimated_start_at: str | None
    start_estimate: StartEstimate | None = None
    """When it is expected to start (a p10..p90 range with its basis), or why unknown."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PendingReason:
        est = d.get("start_estimate")
        return cls(
            code=str(d.get("code")),
            message=str(d.get("message") or d.get("code") or "pending"),
            details=dict(d.get("details") or {}),
            position=d.get("position"),
            estimated_start_at=_str(d.get("estimated_start_at")),
            start_estimate=StartEstimate.from_dict(est) if isinstance(est, dict) else None,
        )


@dataclass(frozen=True, slots=True)
class Job:
    """A job as ``GET /v1/jobs/{id}`` shows it."""

    job_id: str
    name: str
    team: str | None
    status: str
    priority: str | None
    gpu_count: int
    gpu_types: tuple[str, ...]
    command: tuple[str, ...]
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    failure_reason: str | None
    result_uri: str | None
    attempts: tuple[Attempt, ...]
    pending_reason: PendingReason | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    held: bool = False
    """Held (``hold``): not placed until released."""
    array_id: str | None = None
    array_index: int | None = None
    depends_on: tuple[dict[str, str], ...] = ()
    """``({"type": "afterok", "job_id": ...}, ...)``."""
    max_runtime_s: float | None = None
    owner: str | None = None
    """The user whose token submitted it (None: made outside the API, or an older server)."""
    elapsed_s: float | None = None
    """Seconds its latest attempt has run (to its end, or to the server's now while it runs;
    None: never started)."""
    time_left_s: float | None = None
    """While RUNNING with a ``max_runtime_s``: seconds of it left (else None)."""
    gpu_fraction: float | None = None
    """The share of one GPU it asked for (None: whole GPUs, or an older server)."""
    processes_unverified: str | None = None
    """Set while the code of one of its attempts may still run although the job shows
    otherwise (CANCELLED at once after its node was fenced): which attempt, which node;
    None once the node's agent reported the processes gone."""

    @property
    def done(self) -> bool:
        """The job is in a terminal state."""
        return self.status in TERMINAL_STATES

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCEEDED"

    @property
    def exit_code(self) -> int | None:
        """The last attempt's exit code (None: no attempt finished with one)."""
        for run in reversed(self.attempts):
            if run.exit_code is not None:
                return run.exit_code
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        reason = d.get("pending_reason")
        return cls(
            job_id=str(d.get("job_id")),
            name=str(d.get("name") or ""),
            team=_str(d.get("team")),
            status=str(d.get("status")),
            priority=_str(d.get("priority")),
            gpu_count=int(d.get("gpu_count") or 0),
            gpu_types=tuple(d.get("gpu_types") or ()),
            command=tuple(d.get("command") or ()),
            created_at=_str(d.get("created_at")),
            started_at=_str(d.get("started_at")),
            finished_at=_str(d.get("finished_at")),
            failure_reason=_str(d.get("failure_reason")),
            result_uri=_str(d.get("result_uri")),
            attempts=tuple(Attempt.from_dict(a) for a in d.get("attempts") or ()),
            pending_reason=PendingReason.from_dict(reason) if isinstance(reason, dict) else None,
            raw=d,
            held=bool(d.get("held")),
            array_id=_str(d.get("array_id")),
            array_index=d.get("array_index"),
            depends_on=tuple(dict(x) for x in d.get("depends_on") or ()),
            max_runtime_s=d.get("max_runtime_s"),
            owner=_str(d.get("owner")),
            elapsed_s=d.get("elapsed_s"),
            time_left_s=d.get("time_left_s"),
            gpu_fraction=d.get("gpu_fraction"),
            processes_unverified=_str(d.get("processes_unverified")),
        )


@dataclass(frozen=True, slots=True)
class Submitted:
    """The answer to a submit: the job's id and status, whether the server replayed an earlier
    submit with the same idempotency key, and the key used (keep it to retry safely)."""

    job_id: str
    status: str
    replayed: bool
    idempotency_key: str
    raw: dict[str, Any] = field(repr=False, compare=False)
    array_id: str | None = None
    """Set for an array submit; ``job_id`` is then its first task."""
    job_ids: tuple[str, ...] = ()
    """An array's task job ids, by index (``(job_id,)`` for a single job)."""


@dataclass(frozen=True, slots=True)
class JobPage:
    """One page of ``GET /v1/jobs`` (newest first); ``next_cursor`` is None on the last."""

    items: tuple[Job, ...]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class Node:
    """A node and its free GPUs, as ``GET /v1/nodes`` shows it."""

    node_id: str
    status: str
    gpu_type: str | None
    total_gpus: int
    available_gpus: int
    labels: dict[str, Any]
    last_heartbeat_at: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Node:
        return cls(
            node_id=str(d.get("node_id")),
            status=str(d.get("status")),
            gpu_type=_str(d.get("gpu_type")),
            total_gpus=int(d.get("total_gpus") or 0),
            available_gpus=int(d.get("available_gpus") or 0),
            labels=dict(d.get("labels") or {}),
            last_heartbeat_at=_str(d.get("last_heartbeat_at")),
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class ArrayTask:
    """One task of a job array."""

    job_id: str
    array_index: int
    status: str


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    """``GET /v1/arrays/{id}``: the tasks by index, a count per state, and the ``%N``
    limit on tasks running at once (None: no limit)."""

    array_id: str
    max_running: int | None
    tasks: tuple[ArrayTask, ...]
    counts: dict[str, int]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def done(self) -> bool:
        """Every task is in a terminal state."""
        return all(t.status in TERMINAL_STATES for t in self.tasks)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArrayInfo:
        return cls(
            array_id=str(d.get("array_id")),
            max_running=d.get("max_running"),
            tasks=tuple(
                ArrayTask(str(t["job_id"]), int(t.get("array_index") or 0), str(t["status"]))
                for t in d.get("tasks") or ()
            ),
            counts={str(k): int(v) for k, v in (d.get("counts") or {}).items()},
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class CancelResult:
    """``POST /v1/jobs/cancel``: ``cancelled`` (``{job_id, status}`` after the request; with
    ``dry_run``, what would be) and ``skipped`` (already finished)."""

    cancelled: tuple[dict[str, Any], ...]
    skipped: tuple[dict[str, Any], ...]
    dry_run: bool
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def job_ids(self) -> tuple[str, ...]:
        return tuple(str(c["job_id"]) for c in self.cancelled)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CancelResult:
        return cls(
            cancelled=tuple(d.get("cancelled") or ()),
            skipped=tuple(d.get("skipped") or ()),
            dry_run=bool(d.get("dry_run")),
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class UsageLine:
    """One group of a usage report: ``key`` is the team, user (token owner), job id or GPU
    type; GPU-seconds inside the window; attempts and distinct jobs counted."""

    key: str
    team: str | None
    gpu_seconds: float
    gpu_hours: float
    attempts: int
    jobs: int
    peak_rss_bytes: int | None = None
    """Highest peak memory of the group's attempts, bytes (None: not measured)."""
    cpu_seconds: float | None = None
    gpu_util_pct: float | None = None
    gpu_mem_peak_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class UsageReport:
    """``GET /v1/usage``: GPU-time of ended attempts inside ``[since, until)`` (ISO-8601
    UTC; ``since`` None = from the start), each attempt clipped to the window (Slurm sreport
    semantics), grouped ``by`` team, user, job or gpu_type, largest first."""

    since: str | None
    until: str
    by: str
    team: str | None
    items: tuple[UsageLine, ...]
    total_gpu_seconds: float
    total_gpu_hours: float
    raw: dict[str, Any] = field(repr=False, compare=False)

    def hours_by_key(self) -> dict[str, float]:
        """``{key: gpu_hours}`` (for ``by="user"`` keys repeat across teams: use ``items``)."""
        return {ln.key: ln.gpu_hours for ln in self.items}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UsageReport:
        return cls(
            since=_str(d.get("since")),
            until=str(d.get("until") or ""),
            by=str(d.get("by")),
            team=_str(d.get("team")),
            items=tuple(
                UsageLine(
                    key=str(ln["key"]),
                    team=_str(ln.get("team")),
                    gpu_seconds=float(ln["gpu_seconds"]),
                    gpu_hours=float(ln["gpu_hours"]),
                    attempts=int(ln["attempts"]),
                    jobs=int(ln["jobs"]),
                    peak_rss_bytes=ln.get("peak_rss_bytes"),
                    cpu_seconds=ln.get("cpu_seconds"),
                    gpu_util_pct=ln.get("gpu_util_pct"),
                    gpu_mem_peak_bytes=ln.get("gpu_mem_peak_bytes"),
                )
                for ln in d.get("items") or ()
            ),
            total_gpu_seconds=float(d.get("total_gpu_seconds") or 0.0),
            total_gpu_hours=float(d.get("total_gpu_hours") or 0.0),
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class Artifact:
    """One file of a job's accepted manifest: path (relative, ``/``-separated), size in
    bytes, sha256 (hex)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ArtifactList:
    """``GET /v1/jobs/{id}/artifacts``: the files of the attempt that succeeded."""

    job_id: str
    run_id: str
    items: tuple[Artifact, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArtifactList:
        return cls(
            job_id=str(d.get("job_id")),
            run_id=str(d.get("run_id")),
            items=tuple(
                Artifact(str(f["path"]), int(f["size"]), str(f["sha256"]))
                for f in d.get("items") or ()
            ),
            raw=d,
        )


JobRef = str | Job | Submitted
"""Anything naming a job: its id (or whatever the server accepts in its place) or an object
with ``job_id``."""


def job_id_of(ref: JobRef) -> str:
    """The job reference as a path segment.

    Raises:
        ValueError: an empty (or blank) reference: it would name no job but another route.
    """
    job_id = ref if isinstance(ref, str) else ref.job_id
    if not job_id.strip():
        raise ValueError("job: a job reference must not be empty")
    return job_id


def job_segment(ref: JobRef) -> str:
    """``job_id_of(ref)`` percent-encoded for a URL path: a job's name may hold ``?``, ``#``,
    ``%`` or spaces, which would otherwise end the path or change it."""
    return quote(job_id_of(ref), safe="")


def array_id_of(ref: str | Submitted) -> str:
    """The array reference (id, unique id prefix or name) as a path segment (percent-encoded
    as ``job_segment`` is).

    Raises:
        ValueError: an empty reference, or the ``Submitted`` of a job that is not an array.
    """
    if not isinstance(ref, str) and ref.array_id is None:
        raise ValueError(f"array_id: job {ref.job_id} was not submitted as an array")
    array_id = ref if isinstance(ref, str) else ref.array_id or ""
    if not array_id.strip():
        raise ValueError("array_id: an array reference must not be empty")
    return quote(array_id, safe="")
