"""Request and response bodies of REST API v1 (``JobCreate`` in, ``JobOut`` out)."""

from __future__ import annotations

import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gpufleet.domain.images import reference_problem
from gpufleet.domain.mounts import MAX_MOUNTS, MAX_SHM_MB, Mount, mount_problems, parse_mount
from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.domain.webhooks import MAX_URL_LENGTH, MAX_URLS, url_problem
from gpufleet.services.limits import (
    MAX_GPUS,
    MAX_OUTSTANDING_JOBS,
    MAX_RUNTIME_S,
    MAX_SUBMIT_BURST,
    MAX_SUBMIT_RATE_PER_S,
    MAX_WEIGHT,
    MIN_WEIGHT,
)

MAX_ENV_BYTES = 64 * 1024
Name = Annotated[str, Field(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")]
"""A job name (or a filter on names): no control character (a newline or an escape sequence
would forge lines in the CLI's tables and logs; NUL PostgreSQL text cannot hold)."""
MAX_DURATION_S = 366 * 86400.0
"""The longest ``max_runtime_s`` / ``expected_duration_s`` accepted, seconds (366 days): a
larger one is a typo (units) and would be read as "no estimate" by the predictions."""


class DependencyIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["afterok", "afterany", "afternotok"] = "afterok"
    job_id: str = Field(min_length=1, max_length=256)


MAX_PIDS_LIMIT = 4_194_304
"""The kernel's largest ``pid_max`` (``PID_MAX_LIMIT`` on 64-bit)."""
MIN_DISK_MB = 16
"""The smallest scratch filesystem an agent makes (ext4 needs a few MiB of its own)."""
MAX_DISK_MB = 64 * 1024 * 1024
"""64 TiB."""


class MountIn(BaseModel):
    """A host path mounted into a container job (always ``nosuid,nodev``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    source: str = Field(min_length=1, max_length=4096)
    """Absolute host path; must be under a path the fleet (``GPUFLEET_ALLOWED_MOUNTS``) and
    the node (``gpufleet agent --allow-mount``) allow."""
    target: str = Field(min_length=1, max_length=4096)
    """Absolute path inside the container; not under /proc, /sys, /dev, nor on the job's
    own mounts (/gpufleet, /tmp, /var/tmp)."""
    read_only: bool = False


class JobCreate(BaseModel):
    """POST /v1/jobs body. Unknown fields are rejected (a typo must not be silently ignored)."""

    # strict: "2", true or 2.0 is not a GPU count; a typo'd field is an error, not ignored
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    name: Name = ""
    command: list[Annotated[str, Field(max_length=16384)]] = Field(min_length=1, max_length=1024)
    image: str | None = Field(default=None, min_length=1, max_length=512)
    """A container image; null (or absent) runs a process job. An empty name is refused."""
    gpu_count: int = Field(default=1, ge=1, le=1024)
    nodes: int | None = Field(default=None, ge=1, le=1024)
    """Members of a multi-node (gang) job; None derives it (1 when gpu_count fits a node)."""
    gpus_per_node: int | None = Field(default=None, ge=1, le=1024)
    """GPUs of each member; with ``nodes``, ``nodes x gpus_per_node`` is ``gpu_count`` (given
    alone, gpu_count defaults to that product)."""
    allow_partial_nodes: bool = False
    """A derived gang may split ``gpu_count`` unevenly over nodes (e.g. 12 as 8 + 4)."""
    gpu_fraction: float | None = Field(default=None, gt=0, lt=1)
    """A share of ONE GPU (0 < f < 1, in the fleet's steps, 1/8 by default); gpu_count must
    then be 1. None: whole GPUs."""
    gpu_type: str | list[str] | None = None
    gpu_memory_mb: int = Field(default=0, ge=0, le=10_000_000)
    cpu: float = Field(default=0.0, ge=0, le=100_000)
    memory_mb: int = Field(default=0, ge=0, le=100_000_000)
    priority: Literal["CRITICAL", "HIGH", "NORMAL", "LOW"] = "NORMAL"
    max_retries: int = Field(default=0, ge=0, le=100)
    expected_duration_s: float | None = Field(default=None, gt=0, le=MAX_DURATION_S)
    max_runtime_s: float | None = Field(default=None, gt=0, le=MAX_DURATION_S)
    env: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    preemptible: bool = True
    working_dir: str | None = Field(default=None, max_length=4096)
    pids_limit: int | None = Field(default=None, ge=1, le=MAX_PIDS_LIMIT)
    """Most processes and threads at once (the cgroup's pids.max); None: the node's default."""
    disk_mb: int | None = Field(default=None, ge=MIN_DISK_MB, le=MAX_DISK_MB)
    """Size of each attempt's scratch filesystem, MiB; None: the node's default."""
    mounts: list[MountIn] = Field(default_factory=list, max_length=MAX_MOUNTS)
    """Host paths mounted into a container job: objects, or ``"SRC:DST[:ro]"`` strings."""
    shm_size_mb: int | None = Field(default=None, ge=1, le=MAX_SHM_MB)
    """Size of ``/dev/shm`` (container and process jobs), MiB; None: a quarter of
    ``memory_mb``, at least 1024 MiB (``domain.mounts.default_shm_mb``)."""
    notify: list[Annotated[str, Field(max_length=MAX_URL_LENGTH)]] = Field(
        default_factory=list, max_length=MAX_URLS
    )
    """Webhook URLs (http/https) POSTed the job's final record, signed (X-Gpufleet-Signature)
    when it ends; empty: the team's default URLs."""
    array: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Job array, Slurm syntax: 0-99, 1,3,5, 0-15:4, with %N = max running.",
    )
    depends_on: str | list[DependencyIn] | None = Field(
        default=None,
        description="afterok:ID[:ID],afterany:ID,afternotok:ID (Slurm syntax) or a list.",
    )
    hold: bool = Field(default=False, description="Submit held: not placed until released.")

    @model_validator(mode="before")
    @classmethod
    def _no_nul_bytes(cls, data: Any) -> Any:
        """PostgreSQL text cannot hold NUL, and no process argument or path can either."""
        if isinstance(data, dict):
            for key, value in data.items():
                if _has_nul(value):
                    raise PydanticCustomError(
                        "nul_byte",
                        "{field} must not contain NUL (\\u0000) characters",
                        {"field": str(key)},
                    )
        return data

    @field_validator("gpu_type", "depends_on", mode="before")
    @classmethod
    def _string_or_list(cls, v: Any, info: ValidationInfo) -> Any:
        """A non-empty string, a list or null: anything else is refused naming the field
        itself (the union's own errors would name a member: ``depends_on.str``)."""
        if v is not None and not isinstance(v, str | list):
            raise PydanticCustomError(
                "string_or_list",
                "{field} must be a string or a list, not {kind}",
                {"field": str(info.field_name), "kind": type(v).__name__},
            )
        if v == "":
            raise PydanticCustomError(
                "string_too_short",
                "{field} must not be empty (leave it out instead)",
                {"field": str(info.field_name)},
            )
        return v

    @field_validator("depends_on", mode="before")
    @classmethod
    def _dependency_items(cls, v: Any) -> Any:
        """Each item of a ``depends_on`` list validated here, so that an error names
        ``depends_on`` and the item (not the union member ``depends_on.str``)."""
        if not isinstance(v, list):
            return v
        items = []
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                raise PydanticCustomError(
                    "dependency",
                    "depends_on[{i}] must be a mapping with job_id (and type: afterok by default)",
                    {"i": i},
                )
            try:
                items.append(DependencyIn.model_validate(item))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in first["loc"])
                raise PydanticCustomError(
                    "dependency",
                    "depends_on[{i}]{where}: {msg}",
                    {"i": i, "where": where, "msg": first["msg"]},
                ) from None
        return items

    @field_validator("mounts", mode="before")
    @classmethod
    def _mount_strings(cls, v: Any) -> Any:
        """``"SRC:DST[:ro]"`` items (the CLI's and job files' form) as objects."""
        if not isinstance(v, list):
            return v
        out = []
        for i, item in enumerate(v):
            if isinstance(item, str):
                try:
                    item = parse_mount(item).to_json()
                except ValueError as exc:
                    raise PydanticCustomError(
                        "mount", "mounts[{i}]: {msg}", {"i": i, "msg": str(exc)}
                    ) from None
            out.append(item)
        return out

    @model_validator(mode="after")
    def _mount_paths(self) -> JobCreate:
        problems = mount_problems([Mount(m.source, m.target, m.read_only) for m in self.mounts])
        if problems:
            field, message = problems[0]
            raise PydanticCustomError("mount", message, {"field": field})
        if self.mounts and self.image is None:
            raise PydanticCustomError(
                "mount",
                "mounts are for container jobs (give an image); a process job reads host"
                " paths directly, as its user",
                {"field": "mounts"},
            )
        return self

    @field_validator("notify")
    @classmethod
    def _webhook_urls(cls, v: list[str]) -> list[str]:
        for i, url in enumerate(v):
            if (problem := url_problem(url)) is not None:
                which = f" (entry {i + 1})" if len(v) > 1 else ""
                raise ValueError(f"notify URL {url[:200]!r}{which} {problem}")
        return v

    @field_validator("image")
    @classmethod
    def _image_reference(cls, v: str | None) -> str | None:
        """An OCI reference (``domain.images.reference_problem``): never an engine option."""
        if v is not None and (problem := reference_problem(v)) is not None:
            raise ValueError(f"image reference {v[:80]!r} {problem}")
        return v

    @field_validator("working_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("working_dir must be an absolute path")
        return v

    @field_validator("command", mode="before")
    @classmethod
    def _split_string_command(cls, v: Any) -> Any:
        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("command")
    @classmethod
    def _nonempty_program(cls, v: list[str]) -> list[str]:
        if not v[0].strip():
            raise ValueError("the first element (the program) must not be empty")
        return v

    @field_validator("gpu_type")
    @classmethod
    def _types(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not t.strip() or len(t) > 64 for t in items) or len(items) > 16:
            raise ValueError("GPU types must be 1-64 characters, at most 16 of them")
        return v

    @field_validator("env")
    @classmethod
    def _env_size(cls, v: dict[str, str]) -> dict[str, str]:
        size = sum(len(k.encode()) + len(val.encode()) for k, val in v.items())
        if size > MAX_ENV_BYTES:
            raise ValueError(f"env is {size} bytes; the limit is {MAX_ENV_BYTES}")
        bad = [k for k in v if not k or "=" in k or "\0" in k or k.startswith("GPUFLEET_")]
        if bad:
            raise ValueError(f"invalid or reserved env names: {bad[:5]}")
        return v

    @model_validator(mode="after")
    def _gang_shape(self) -> JobCreate:
        """``nodes x gpus_per_node == gpu_count`` (gpu_count derived when not given);
        one of them alone must divide gpu_count unless ``allow_partial_nodes``."""
        n, per = self.nodes, self.gpus_per_node

        def bad(field: str, message: str) -> PydanticCustomError:
            return PydanticCustomError("gang_shape", message, {"field": field})

        if n and per:
            if "gpu_count" not in self.model_fields_set:
                self.gpu_count = n * per
            elif n * per != self.gpu_count:
                return_error = f"nodes x gpus_per_node ({n} x {per}) must equal gpu_count"
                raise bad("gpu_count", f"{return_error} ({self.gpu_count})")
            if self.gpu_count > 1024:
                raise bad("nodes", f"nodes x gpus_per_node = {self.gpu_count} is above 1024")
        elif (n or per) and "gpu_count" not in self.model_fields_set:
            which, other = ("nodes", "gpus_per_node") if n else ("gpus_per_node", "nodes")
            raise bad(
                other,
                f"{which} {n or per} alone does not say how many GPUs the job needs:"
                f" also give {other}, or gpu_count (the whole job's GPUs)",
            )
        elif (n or per) and self.gpu_count % (n or per or 1) and not self.allow_partial_nodes:
            which = "nodes" if n else "gpus_per_node"
            raise bad(
                which,
                f"gpu_count {self.gpu_count} is not a multiple of {which} {n or per}"
                " (set allow_partial_nodes for an uneven split)",
            )
        if n and n > self.gpu_count:
            raise bad("nodes", f"nodes {n} is more than gpu_count {self.gpu_count}")
        if per and per > self.gpu_count:
            raise bad("gpus_per_node", f"gpus_per_node {per} is more than gpu_count")
        return self

    @model_validator(mode="after")
    def _fraction_shape(self) -> JobCreate:
        """A fraction is a share of one GPU: not with several GPUs, nor with a gang."""
        if self.gpu_fraction is None:
            return self
        if self.gpu_count != 1 or self.nodes or self.gpus_per_node:
            raise PydanticCustomError(
                "gpu_fraction",
                "gpu_fraction is a share of ONE GPU: it needs gpu_count 1 (got {count})"
                " and no nodes/gpus_per_node; ask for whole GPUs instead",
                {"field": "gpu_fraction", "count": self.gpu_count},
            )
        return self

    @model_validator(mode="after")
    def _runtime_bounds(self) -> JobCreate:
        if (
            self.expected_duration_s
            and self.max_runtime_s
            and self.expected_duration_s > self.max_runtime_s
        ):
            raise ValueError("expected_duration_s must not exceed max_runtime_s")
        return self

    def to_spec(self) -> JobSpec:
        types = [self.gpu_type] if isinstance(self.gpu_type, str) else list(self.gpu_type or [])
        return JobSpec(
            command=tuple(self.command),
            resources=Resources(
                self.gpu_count,
                tuple(types),
                self.gpu_memory_mb,
                self.cpu,
                self.memory_mb,
                nodes=self.nodes,
                gpus_per_node=self.gpus_per_node,
                allow_partial_nodes=self.allow_partial_nodes,
                gpu_fraction=self.gpu_fraction,
            ),
            priority=PriorityClass(self.priority),
            name=self.name,
            image=self.image,
            env=dict(sorted(self.env.items())),
            max_retries=self.max_retries,
            expected_duration_s=self.expected_duration_s,
            max_runtime_s=self.max_runtime_s,
            preemptible=self.preemptible,
            node_selector=dict(sorted(self.node_selector.items())),
            working_dir=self.working_dir,
            pids_limit=self.pids_limit,
            disk_mb=self.disk_mb,
            mounts=tuple(Mount(m.source, m.target, m.read_only) for m in self.mounts),
            shm_size_mb=self.shm_size_mb,
            notify=tuple(self.notify),
        )


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


class ErrorOut(BaseModel):
    """Every error answer: a stable code, a sentence, and the request field it concerns."""

    error: str
    message: str
    field: str | None


class JobCreated(BaseModel):
    job_id: str
    status: str
    array_id: str | None = None
    """Set for an array submit: ``job_id`` is then its first task."""
    job_ids: list[str] | None = None
    """An array's task job ids, by index."""
    warnings: list[str] | None = None
    """Set when the team is near or over a GPU-hour budget (``policy.limits``): a soft
    budget at 80% or 100% used, a hard budget used up (the job waits until it renews), the
    job's class budget used up (it runs at NORMAL, or waits)."""


class JobPatch(BaseModel):
    """PATCH /v1/jobs/{id}: the fields a job may change after submit (omit the others)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    priority: Literal["CRITICAL", "HIGH", "NORMAL", "LOW"] | None = None
    name: Name | None = None
    max_runtime_s: float | None = Field(default=None, gt=0, le=MAX_DURATION_S)
    gpu_count: int | None = Field(default=None, ge=1, le=1024, description="PENDING jobs only.")
    gpu_types: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None,
        max_length=16,
        description="Acceptable GPU types, in order of preference ([] = any); PENDING jobs only.",
    )


class BulkCancel(BaseModel):
    """POST /v1/jobs/cancel: the explicit jobs plus, when any filter is given, every job of
    the team matching all filters. Finished jobs are skipped."""

    model_config = ConfigDict(extra="forbid", strict=True)

    job_ids: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list, max_length=10_000
    )
    name: Name | None = None
    state: str | None = Field(
        default=None,
        max_length=256,
        description="A job state, or several as a comma list (any of them): PENDING,RUNNING.",
    )
    array_id: str | None = Field(
        default=None,
        max_length=256,
        description="Only this array's tasks: its id, an id prefix or its name.",
    )
    dry_run: bool = False


class AttemptOut(BaseModel):
    run_id: str
    attempt: int
    status: str
    node_id: str
    gpu_ids: list[int]
    token: int
    exit_code: int | None
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    manifest_uri: str | None
    message: str | None
    stop_reason: str | None
    rank: int = 0
    """This member's rank in a gang attempt (0 for a single-node job)."""
    gang_size: int = 1
    """Members of the attempt; a gang attempt lists one entry per member (same attempt)."""
    start_phases: dict[str, Any] | None = None
    """How the node started it: runtime, image (warm/cold), pull_s, create_s, start_s."""
    last_checkpoint_at: str | None = None
    """The newest file time in the attempt's ``$GPUFLEET_CHECKPOINT_DIR`` its agent reported
    (ISO 8601, UTC; None: none reported). A preemption costs the work done since then."""
    resources: dict[str, int | float] | None = None
    """What the attempt used, as its agent measured it (from its usage record, once it
    ended): ``peak_rss_bytes``, ``cpu_seconds``, ``gpu_util_pct``, ``gpu_mem_peak_bytes``,
    each present only when measured; None: not ended or nothing measured."""
    processes_unverified: str | None = None
    """Set while this attempt's processes may still run: it was FENCED (its node went
    silent) and its agent has not yet reported them gone, e.g. ``"processes not verified
    gone: node n1 unreachable (...)"``; None once they are (or for an attempt never fenced)."""


class StartEstimateOut(BaseModel):
    """When a waiting job is expected to start (the leader's ``policy.start_estimate``,
    recomputed every ~10 s): the p10..p90 range of its start, or why it is unknown."""

    earliest_at: str | None = None
    """The p10 start (ISO 8601 UTC); None when unknown."""
    latest_at: str | None = None
    """The p90 start (ISO 8601 UTC); None when unknown."""
    ahead: int = 0
    """Waiting jobs expected to start before it on the same GPU type."""
    basis: str = ""
    """What the range rests on, e.g. ``running work bounded by time limits``."""
    unknown: str | None = None
    """Why there is no range (words after "unknown because"); None when there is one."""
    reserved: bool = False
    """The scheduler holds a backfill reservation for it."""
    text: str = ""
    """One line, as of the read: ``in 20-45 min; 3 jobs ahead, running work bounded by
    time limits`` or ``unknown because ...``."""


class PendingReasonOut(BaseModel):
    code: str
    message: str
    details: dict[str, Any] = {}
    position: int | None = None
    estimated_start_at: str | None = None
    start_estimate: StartEstimateOut | None = None


class JobOut(BaseModel):
    job_id: str
    name: str
    team: str
    owner: str | None = Field(
        default=None,
        description="The user whose token submitted it (None: made outside the API).",
    )
    status: str
    priority: str
    gpu_count: int
    nodes: int | None = None
    """Members of a multi-node job as submitted (None: derived at placement; 1 node when
    gpu_count fits one)."""
    gpus_per_node: int | None = None
    allow_partial_nodes: bool = False
    gpu_fraction: float | None = None
    """The share of one GPU the job asked for (None: whole GPUs)."""
    gpu_types: list[str]
    command: list[str]
    max_retries: int
    created_at: str | None
    scheduled_at: str | None
    started_at: str | None
    finished_at: str | None
    cancel_requested: bool
    result_uri: str | None
    failure_reason: str | None
    attempts: list[AttemptOut]
    pending_reason: PendingReasonOut | None
    # the spec as submitted, so that `status` shows what will run (env: names only; values
    # may hold secrets and are never sent back)
    image: str | None = None
    working_dir: str | None = None
    pids_limit: int | None = None
    disk_mb: int | None = None
    mounts: list[dict[str, Any]] = []
    """``[{"source", "target", "read_only"}]`` as submitted."""
    shm_size_mb: int | None = None
    """As submitted (None: the default, ``domain.mounts.default_shm_mb``)."""
    notify: list[str] = []
    """The webhooks told of the job's end (its own, else its team's defaults at submit)."""
    cpu: float = 0.0
    memory_mb: int = 0
    gpu_memory_mb: int = 0
    expected_duration_s: float | None = None
    max_runtime_s: float | None = None
    elapsed_s: float | None = Field(
        default=None,
        description="Seconds the latest attempt has run (to its end, or to now while it"
        " runs; the database's clock); None: never started.",
    )
    time_left_s: float | None = Field(
        default=None,
        description="While RUNNING with a max_runtime_s: seconds of it left for this"
        " attempt (>= 0); else None.",
    )
    preemptible: bool = True
    node_selector: dict[str, str] = {}
    env_keys: list[str] = []
    array_id: str | None = None
    array_index: int | None = None
    depends_on: list[dict[str, str]] | None = None
    """``[{"type": "afterok", "job_id": ...}]``."""
    held: bool = False
    node_problems: list[dict[str, Any]] = []
    """Nodes this job waits on that cannot take work now: ``node_id``, ``status`` (SUSPECT,
    QUARANTINED, UNHEALTHY, CORDONED, DRAINING, FENCED) and ``reason``."""
    processes_unverified: str | None = None
    """Set while the code of one of its attempts may still run although the job shows
    otherwise (CANCELLED at once after a fence, or running again elsewhere): ``"attempt
    r-...: processes not verified gone: node n1 unreachable (...)"`` until that node's agent
    reports the processes gone (its GPUs stay QUARANTINED meanwhile, so nothing else is
    placed on them). See each attempt's ``processes_unverified``."""


class JobList(BaseModel):
    items: list[JobOut]
    next_cursor: str | None


class NodeOut(BaseModel):
    node_id: str
    status: str
    gpu_type: str
    gpu_memory_mb: int
    total_gpus: int
    available_gpus: int
    labels: dict[str, Any]
    """The effective labels: the agent's, with the admin-set ones over them."""
    admin_labels: dict[str, str] = {}
    """The labels an admin set (``PUT/PATCH /v1/admin/nodes/{id}/labels``); they survive the
    agent's re-registrations and win over its labels on a shared key."""
    address: str | None
    """The agent's gRPC address; admin tokens only (null for others)."""
    last_heartbeat_at: str | None
    agent_epoch: int
    status_reason: str | None = None
    """Why the node is not HEALTHY (cordon reason, failed health check, fence)."""
    reported_gpus: int | None = None
    """A pending change of GPUs: the GPU count its agent last registered with when that
    differs (in count or type) from the recorded ``total_gpus``/``gpu_type`` and could not be
    recorded because GPUs were reserved. The node drains and cannot be uncordoned until its
    agent registers again; null when the recorded GPUs are the agent's."""
    reported_gpu_type: str | None = None
    """The GPU type of that registration (null with ``reported_gpus``)."""
    health: dict[str, Any] | None = None
    """The agent's last health report: health, disk_free_mb, recent_start_failures."""
    images: list[str] = []
    """Container images the node holds (names), from its heartbeats."""
    gpu_sharing: str = "none"
    """Whether jobs asking for a GPU fraction may share its GPUs: none, timeslice or mps
    (its agent's ``--gpu-sharing``)."""
    shared_gpus: dict[str, float] = {}
    """GPU index -> the fraction of it share reservations hold now (GPUs with shares
    only; a shared GPU is not in ``available_gpus``)."""


class NodeList(BaseModel):
    items: list[NodeOut]


class NodeLabelsPut(BaseModel):
    """``PUT /v1/admin/nodes/{id}/labels``: the node's admin labels become exactly these."""

    model_config = ConfigDict(extra="forbid")
    labels: dict[str, str] = Field(
        description="key -> value; keys and values follow Kubernetes label syntax "
        "(a key `[prefix/]name`, name and value up to 63 of A-Z a-z 0-9 - _ .)."
    )


class NodeLabelsPatch(BaseModel):
    """``PATCH /v1/admin/nodes/{id}/labels``: a JSON merge patch (RFC 7386) of the node's
    admin labels: a string sets the label, ``null`` removes it, absent keys stay."""

    model_config = ConfigDict(extra="forbid")
    labels: dict[str, str | None] = Field(description="key -> value, or null to remove")


class NodeLabelsOut(BaseModel):
    node_id: str
    labels: dict[str, str]
    """Effective labels (what placement and node_selector see)."""
    admin_labels: dict[str, str]
    agent_labels: dict[str, str]


class TeamCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=64)
    weight: float = Field(default=1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT)


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    team: str = Field(min_length=1, max_length=64)
    name: str = Field(default="", max_length=128, pattern=r"^[^\x00]*$")
    user: str | None = Field(
        default=None,
        max_length=64,
        description="The person the token stands for: the owner of the jobs it submits"
        " (1-64 of letters, digits and _ . @ + -). Default: the name when it is a valid user"
        " name, else the token's id.",
    )
    admin: bool = False
    create_team: bool = Field(default=False, description="Create the team if it is missing.")


class JoinTokenCreate(BaseModel):
    """POST /v1/admin/nodes/join-tokens."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    node_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="The only node id it may join as; null = any id not in use.",
    )
    ttl_s: float = Field(default=900, ge=10, le=7 * 86400, description="Lifetime, seconds.")


GpuCount = Annotated[int, Field(ge=0, le=MAX_GPUS)]
PerType = Annotated[dict[Annotated[str, Field(max_length=64)], GpuCount], Field(max_length=64)]


class TokenOut(BaseModel):
    """A token as operators see it (never the token or its hash)."""

    id: str
    team: str
    name: str
    user: str = Field(description="The person the token stands for (its jobs' owner).")
    admin: bool
    created_at: str | None
    revoked_at: str | None


class TokenList(BaseModel):
    items: list[TokenOut]


class TeamQuotaUpdate(BaseModel):
    """PUT /v1/admin/teams/{team}: fields left out are unchanged. Kueue's names are accepted
    for the quota: ``nominal_quota`` (= ``guaranteed_gpus``), ``borrowing_limit``
    (= ``borrow_limit_gpus``; -1 = none) and ``lending_limit`` (Kueue's ``lendingLimit``: the
    most of the guarantee other teams may borrow). ``lending_limit_gpus`` is deprecated: it
    meant the part never lent, and is converted (a warning says so). max_outstanding_jobs 0
    and submit_rate_per_s 0 = no limit (a team never set uses the server's defaults).
    ``default_max_runtime_s`` / ``max_runtime_limit_s`` (seconds, Slurm's DefaultTime and
    MaxTime): the ``max_runtime_s`` given to a job submitted without one, and the most a job
    may ask for; 0 removes either."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    weight: float | None = Field(default=None, ge=MIN_WEIGHT, le=MAX_WEIGHT)
    nominal_quota: PerType | None = None
    guaranteed_gpus: PerType | None = None
    borrowing_limit: int | None = Field(default=None, ge=-1, le=MAX_GPUS)
    borrow_limit_gpus: int | None = Field(default=None, ge=-1, le=MAX_GPUS)
    lending_limit: PerType | None = None
    lending_limit_gpus: PerType | None = Field(
        default=None,
        description="Deprecated (use lending_limit): the part of the guarantee never lent.",
        json_schema_extra={"deprecated": True},
    )
    max_outstanding_jobs: int | None = Field(default=None, ge=0, le=MAX_OUTSTANDING_JOBS)
    submit_rate_per_s: float | None = Field(default=None, ge=0, le=MAX_SUBMIT_RATE_PER_S)
    submit_burst: int | None = Field(default=None, ge=1, le=MAX_SUBMIT_BURST)
    read_rate_per_s: float | None = Field(default=None, ge=0, le=MAX_SUBMIT_RATE_PER_S)
    read_burst: int | None = Field(default=None, ge=1, le=MAX_SUBMIT_BURST)
    default_max_runtime_s: float | None = Field(default=None, ge=0, le=MAX_RUNTIME_S)
    max_runtime_limit_s: float | None = Field(default=None, ge=0, le=MAX_RUNTIME_S)
    limits: dict[str, Any] | None = Field(
        default=None,
        description="Allowed priority classes, class budgets and GPU-hour budgets"
        " (docs/design/scheduling-policy.md, 'Team limits'); {} removes them.",
    )

    @model_validator(mode="after")
    def _one_name_each(self) -> TeamQuotaUpdate:
        for new, old in (
            ("nominal_quota", "guaranteed_gpus"),
            ("borrowing_limit", "borrow_limit_gpus"),
            ("lending_limit", "lending_limit_gpus"),
        ):
            if getattr(self, new) is not None and getattr(self, old) is not None:
                raise PydanticCustomError(
                    "one_name", "give {new} or {old}, not both", {"new": new, "old": old}
                )
        return self

    def to_update(self) -> dict[str, Any]:
        """Keyword arguments of ``services.teams.QuotaUpdate``."""
        return {
            "weight": self.weight,
            "guaranteed_gpus": self.nominal_quota
            if self.nominal_quota is not None
            else self.guaranteed_gpus,
            "borrow_limit_gpus": self.borrowing_limit
            if self.borrowing_limit is not None
            else self.borrow_limit_gpus,
            "lending_limit": self.lending_limit,
            "never_lent_gpus": self.lending_limit_gpus,
            "max_outstanding_jobs": self.max_outstanding_jobs,
            "submit_rate_per_s": self.submit_rate_per_s,
            "submit_burst": self.submit_burst,
            "read_rate_per_s": self.read_rate_per_s,
            "read_burst": self.read_burst,
            "default_max_runtime_s": self.default_max_runtime_s,
            "max_runtime_limit_s": self.max_runtime_limit_s,
            "limits": self.limits,
        }
