"""ORM tables (SQLAlchemy 2). One schema for SQLite and PostgreSQL; one Alembic chain.

Statuses are stored as strings and written only by ``store/transitions.py``. Times are UTC
(``*_at``), taken from the database clock (``dialect.db_now``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on both databases (SQLite stores naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: gpufleet stores UTC-aware datetimes only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(
        self,
        value: datetime | None,
        dialect: Dialect,  # noqa: ARG002 - the TypeDecorator signature
    ) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime,
        dict[str, Any]: JSON,
        list[int]: JSON,
        list[str]: JSON,
        list[dict[str, Any]]: JSON,
    }


ACTIVE_RUN_SQL = "status IN ('ASSIGNED', 'RUNNING', 'PREEMPTING')"
ACTIVE_RESERVATION_SQL = "status IN ('RESERVED', 'CONFIRMED')"


class TeamRow(Base):
    __tablename__ = "teams"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    """The team name, as used in tokens and the API."""
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    guaranteed_gpus: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """GPU type -> guaranteed GPUs."""
    borrow_limit_gpus: Mapped[int | None] = mapped_column(Integer, default=None)
    lending_limit_gpus: Mapped[dict[str, Any]] = mapped_column(default=dict)
    max_outstanding_jobs: Mapped[int | None] = mapped_column(Integer, default=None)
    """Unfinished jobs allowed; NULL = the server's default, 0 = no limit."""
    submit_rate_per_s: Mapped[float | None] = mapped_column(Float, default=None)
    """Token-bucket refill rate of POST /v1/jobs; NULL = the server's default, 0 = no limit."""
    submit_burst: Mapped[int | None] = mapped_column(Integer, default=None)
    """Token-bucket size (submits allowed at once); NULL = the server's default."""
    read_rate_per_s: Mapped[float | None] = mapped_column(Float, default=None)
    """Read token-bucket refill (GETs of the API, tokens/s); NULL = the server's default,
    0 = no limit."""
    read_burst: Mapped[int | None] = mapped_column(Integer, default=None)
    """Read token-bucket size; NULL = the server's default."""
    default_max_runtime_s: Mapped[float | None] = mapped_column(Float, default=None)
    """``max_runtime_s`` given to a job submitted without one (Slurm's DefaultTime); NULL =
    none (the job runs unbounded)."""
    max_runtime_limit_s: Mapped[float | None] = mapped_column(Float, default=None)
    """The most ``max_runtime_s`` a job may ask for (Slurm's MaxTime); a submit above it is
    refused (422); NULL = no limit."""
    usage_gpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    """Charged GPU-seconds of finished attempts (every attempt, whatever its outcome), decayed
    to ``usage_as_of`` (``policy.usage``: half-life ``usage_half_life_s``)."""
    usage_as_of: Mapped[datetime | None]
    limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """Allowed priority classes, class budgets and GPU-hour budgets (migration 0011e;
    ``services.team_limits`` validates it, ``store.team_limits`` reads it); None = none."""
    created_at: Mapped[datetime]
    notify_secret: Mapped[str | None] = mapped_column(String(128))
    """HMAC-SHA256 key of the team's completion webhooks (``services.notify``); NULL until
    first read or rotated (migration 0011b)."""
    notify_urls: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    """Webhook URLs a job of the team submitted without ``notify`` is given; NULL = none."""


class ApiTokenRow(Base):
    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id"), index=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    user_name: Mapped[str] = mapped_column(String(64), default="", server_default="")
    """The person the token stands for (``jobs.owner`` of what it submits; migration 0011a):
    given at creation, else the token's name when that is a valid user name, else its id."""
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("team_id", "idempotency_key"),
        Index("ix_jobs_status_queue", "status", "priority_rank", "queued_at"),
        Index("ix_jobs_team_id_created", "team_id", "id"),
        Index("ix_jobs_status_gated", "status", "gated"),
        Index("ix_jobs_array_id", "array_id"),
        Index("ix_jobs_team_id_name", "team_id", "name"),
        Index("ix_jobs_team_id_owner", "team_id", "owner", "id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id"))
    name: Mapped[str] = mapped_column(String(256), default="")
    idempotency_key: Mapped[str] = mapped_column(String(256))
    payload_sha256: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]]
    """The normalized, immutable JobSpec (JSON)."""
    priority: Mapped[str] = mapped_column(String(16))
    priority_rank: Mapped[int] = mapped_column(Integer)
    gpu_count: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(24))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    current_run_id: Mapped[str | None] = mapped_column(String(40))
    fencing_epoch: Mapped[int] = mapped_column(Integer, default=0)
    """Token of the current attempt; one higher for every new attempt (never reused)."""
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    result_uri: Mapped[str | None] = mapped_column(Text)
    failure_reason: Mapped[str | None] = mapped_column(Text)
    pending_reason: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    max_runtime_s: Mapped[float | None] = mapped_column(Float)
    """Copy of ``spec.max_runtime_s``, so the stop driver's scan reads no JSON."""
    submitted_by: Mapped[str | None] = mapped_column(String(64))
    """Id of the API token that submitted it (accounting's "user"); None for jobs made
    before it was recorded or outside the API."""
    owner: Mapped[str | None] = mapped_column(String(64))
    """The submitting token's ``user_name`` (``list --user/--mine``; migration 0011a); None for a
    job made outside the API or by a token since deleted."""
    retry_after: Mapped[datetime | None]
    """A retry after a failure is not placed before this time (exponential backoff)."""
    held: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    """Held by its user (``POST /v1/jobs/{id}/hold``, ``submit --hold``): never placed."""
    gated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    """Has a gate the scheduler checks each pass (held, dependencies, an array's max-running
    limit): only such PENDING rows are read by ``store.gating``."""
    array_id: Mapped[str | None] = mapped_column(String(40))
    """The job array this job is a task of (``a-...``), or NULL."""
    array_index: Mapped[int | None] = mapped_column(Integer)
    array_max_running: Mapped[int | None] = mapped_column(Integer)
    """The array's ``%N``: at most N of its tasks' attempts hold GPUs at once (SCHEDULED or
    RUNNING, or fenced with QUARANTINED GPUs: ``store.gating.array_holders``)."""
    depends_on: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    """``[{"type": "afterok"|"afterany"|"afternotok", "job_id": ...}]``, or NULL."""
    notify_urls: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    """Webhooks told of the job's end: its own ``notify``, else its team's defaults at
    submit; NULL = none (no outbox row at its end). Migration 0011b."""
    created_at: Mapped[datetime]
    queued_at: Mapped[datetime]
    scheduled_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    change_seq: Mapped[int] = mapped_column(BigInteger, server_default="0", index=True)
    """Set by a database trigger on insert and on a change of a column the scheduler's
    snapshot reads (migration 0006s, ``store.snapshot_cache``); never written by the code."""


class JobRunRow(Base):
    """One attempt on one node, or one member of a gang attempt: one node, one reservation,
    the attempt's fencing token (shared by every member of a gang). Never reused."""

    __tablename__ = "job_runs"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "rank"),
        # Invariant 3 backstop: at most one active attempt per job (one active member per
        # rank for a gang; that the members share one attempt is checked by the checker).
        Index(
            "uq_job_runs_one_active_per_rank",
            "job_id",
            "rank",
            unique=True,
            sqlite_where=text(ACTIVE_RUN_SQL),
            postgresql_where=text(ACTIVE_RUN_SQL),
        ),
        Index("ix_job_runs_node_status", "node_id", "status"),
        Index("ix_job_runs_stop_requested_at", "stop_requested_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    status: Mapped[str] = mapped_column(String(16))
    token: Mapped[int] = mapped_column(Integer)
    gpu_ids: Mapped[list[int]]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    manifest_uri: Mapped[str | None] = mapped_column(Text)
    checkpoint_prefix: Mapped[str | None] = mapped_column(Text)
    """Object-store key prefix of the checkpoints this attempt stored (resume source)."""
    message: Mapped[str | None] = mapped_column(Text)
    stop_reason: Mapped[str | None] = mapped_column(String(16))
    """cancel | preempt | timeout | stale, while PREEMPTING and after."""
    stop_requested_at: Mapped[datetime | None]
    preempted_for_job_id: Mapped[str | None] = mapped_column(String(40))
    """The job these GPUs are being freed for (stop_reason preempt)."""
    priority: Mapped[str | None] = mapped_column(String(16))
    """The class the attempt was placed at when a team limit demoted it (migration 0011e;
    None: its job's class): what preemption sees and what its GPU-time is charged to."""
    preempt_reason: Mapped[str | None] = mapped_column(String(16))
    """The policy's ground for a preempt stop: ``reclaim``, ``priority`` or ``defragment``
    (``Preempt.reason``); read back as ``ClusterSnapshot.recent_displacements``."""
    assigned_at: Mapped[datetime | None]
    """When AssignJob was last answered by the agent (None: not yet delivered)."""
    charged_to: Mapped[str | None] = mapped_column(String(8))
    """Whose fault an unsuccessful end was: ``job`` (counts against ``max_retries``), ``node``
    (a start failure the node caused, or the node was lost: counts against the node-loss
    budget), ``refused`` (the agent refused it on a failed health check: the node's, but
    neither a start failure towards auto-cordon nor a node loss) or ``system`` (fencing, a
    refused stale assignment: counts against nothing)."""
    rank: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """This member's rank in its gang attempt (0 for a single-node job); rank 0 is the
    job's ``current_run_id`` and hosts ``MASTER_ADDR``."""
    gang_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """Members of the attempt (1: a single-node job)."""
    master_port: Mapped[int | None] = mapped_column(Integer)
    """Rank 0 of a gang: the free port its agent chose for ``MASTER_PORT``."""
    gang_outcome: Mapped[str | None] = mapped_column(String(16))
    """A gang member that ended unsuccessfully first (not stopped because of the gang): the
    job status the whole attempt ends in, applied when its last member ends."""
    start_phases: Mapped[dict[str, Any] | None]
    """How the node started it (seconds): runtime, image warm/cold, pull_s, create_s, start_s."""
    last_checkpoint_at: Mapped[datetime | None]
    """The newest file time in the attempt's checkpoint directory, as its agent last reported
    it in a heartbeat (``services.node_heartbeat``; never earlier than a value stored before,
    never more than the database clock); None: no checkpoint reported. A preemption loses the
    work since the later of ``started_at`` and this."""
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    change_seq: Mapped[int] = mapped_column(BigInteger, server_default="0", index=True)
    """Set by a database trigger on insert and on a change of a column the scheduler's
    snapshot reads (migration 0006s, ``store.snapshot_cache``); never written by the code."""


class ReservationRow(Base):
    """Which attempt owns which GPUs of which node, under which token and leader epoch."""

    __tablename__ = "reservations"
    __table_args__ = (Index("ix_reservations_node_status", "node_id", "status"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("job_runs.id"), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    gpu_ids: Mapped[list[int]]
    gpu_count: Mapped[int] = mapped_column(Integer)
    """Whole GPUs held (0 for a share reservation)."""
    gpu_milli: Mapped[int] = mapped_column(Integer, server_default="0", default=0)
    """A share reservation's part of its one GPU (``gpu_ids[0]``), thousandths; 0: whole
    GPUs (migration 0012_frac27)."""
    status: Mapped[str] = mapped_column(String(16))
    token: Mapped[int] = mapped_column(Integer)
    leader_epoch: Mapped[int] = mapped_column(Integer)
    lease_expires_at: Mapped[datetime]
    created_at: Mapped[datetime]
    released_at: Mapped[datetime | None]
    change_seq: Mapped[int] = mapped_column(BigInteger, server_default="0", index=True)
    """Set by a database trigger on insert and on a change of a column the scheduler's
    snapshot reads (migration 0006s, ``store.snapshot_cache``); never written by the code."""


class NodeRow(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    address: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))
    gpu_type: Mapped[str] = mapped_column(String(64))
    gpu_memory_mb: Mapped[int] = mapped_column(Integer)
    cpu: Mapped[float] = mapped_column(Float, default=0.0)
    memory_mb: Mapped[int] = mapped_column(Integer, default=0)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """The labels the agent reported at its last registration (replaced by each one)."""
    admin_labels: Mapped[dict[str, Any] | None]
    """Labels an admin set (``PUT/PATCH /v1/admin/nodes/{id}/labels``); kept across agent
    re-registrations and set over the agent's (``domain.labels.effective_labels``)."""
    agent_epoch: Mapped[int] = mapped_column(Integer, default=0)
    inventory_source: Mapped[str] = mapped_column(String(16), default="declared")
    gpu_sharing: Mapped[str] = mapped_column(String(16), server_default="none", default="none")
    """Whether and how its GPUs may be shared (``domain.types.GpuSharing``), as its agent
    reported at registration (migration 0012_frac27)."""
    status_reason: Mapped[str | None] = mapped_column(Text)
    """Why the node is not HEALTHY (an operator's cordon reason, a failed health check...).
    For people: no code reads a state out of it."""
    reported_gpus: Mapped[int | None] = mapped_column(Integer)
    """The GPU count its agent last registered with, when that differs (in count or type) from
    the recorded GPUs and could not be recorded because GPUs were reserved: the node drains,
    and may not be uncordoned until the agent registers again (``services.nodes``). NULL: the
    recorded GPUs are the agent's. Set and cleared with ``reported_gpu_type``."""
    reported_gpu_type: Mapped[str | None] = mapped_column(String(64))
    """The GPU type of that registration (NULL with ``reported_gpus``)."""
    health: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """The agent's last health report: disk free per directory, start failures, problems."""
    images: Mapped[list[dict[str, Any]] | None]
    """The node's local container images from heartbeats: [{name, digest, size_bytes}]."""
    prepull: Mapped[list[str] | None]
    """Images an operator asked the node to pull (sent in the next heartbeat answer)."""
    registered_at: Mapped[datetime]
    last_heartbeat_at: Mapped[datetime | None]
    change_seq: Mapped[int] = mapped_column(BigInteger, server_default="0", index=True)
    """Set by a database trigger on insert and on a change of a column the scheduler's
    snapshot reads (migration 0006s, ``store.snapshot_cache``); never written by the code."""


class JoinTokenRow(Base):
    """A single-use bootstrap token for a node agent (``gpufleet admin node join-token``).
    Stored as sha256; used at most once (``used_at`` set in the same transaction that records
    the certificate it bought)."""

    __tablename__ = "join_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    node_id: Mapped[str | None] = mapped_column(String(128))
    """The node id it may join as; None = any id not yet in use."""
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    used_at: Mapped[datetime | None]
    used_by: Mapped[str | None] = mapped_column(String(128))
    """The node id that used it."""
    used_key_sha256: Mapped[str | None] = mapped_column(String(64))
    """sha256 (hex) of the public key the certificate it bought is for (migration 0010g): a
    repeat of that join (same node, same key, token unexpired) is answered again."""


class NodeCertRow(Base):
    """Every node certificate the controller signed (join and renewal). A call is accepted
    only with a certificate listed here, unrevoked, for the node it names."""

    __tablename__ = "node_certs"
    __table_args__ = (Index("ix_node_certs_node", "node_id"),)

    serial: Mapped[str] = mapped_column(String(40), primary_key=True)
    """Hex serial number."""
    node_id: Mapped[str] = mapped_column(String(128))
    """Not a foreign key: a forgotten node's certificates stay listed (revoked)."""
    issued_at: Mapped[datetime]
    not_after: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    reason: Mapped[str] = mapped_column(String(32), default="join")
    """join | renew."""
    trust_epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """The node's trust epoch when it was issued (a renewal copies its predecessor's); the
    certificate is refused once ``NodeTrustRow.epoch`` is above it (migration 0009e)."""


class NodeTrustRow(Base):
    """Node-level revocation: a node id's trust epoch. Revoke, forget and join raise it by
    one; a certificate whose ``trust_epoch`` is below it is refused, whatever its serial
    (also one renewed while the revocation ran). No row = epoch 0."""

    __tablename__ = "node_trust"

    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer)
    revoked_at: Mapped[datetime | None]
    """The last revocation (or forget); NULL when only joins raised the epoch."""
    updated_at: Mapped[datetime]


class FleetFactRow(Base):
    """Facts of the fleet kept with its database, e.g. ``ca_sha256``: the fingerprint of the
    fleet CA, recorded by the first ``admin ca init`` or controller start (migration 0009e)."""

    __tablename__ = "fleet_facts"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(512))
    recorded_at: Mapped[datetime]


class NodeCapacityRow(Base):
    """``reserved + available = total`` is checked by the invariant checker, never patched."""

    __tablename__ = "node_capacity"
    __table_args__ = (
        CheckConstraint("available_gpus >= 0", name="available_nonnegative"),
        CheckConstraint("available_gpus <= total_gpus", name="available_le_total"),
    )

    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), primary_key=True)
    total_gpus: Mapped[int] = mapped_column(Integer)
    available_gpus: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer, default=0)
    """Bumped by every reserve and release (a compare-and-swap handle and a change counter)."""
    change_seq: Mapped[int] = mapped_column(BigInteger, server_default="0", index=True)
    """Set by a database trigger on insert and on a change of a column the scheduler's
    snapshot reads (migration 0006s, ``store.snapshot_cache``); never written by the code."""


class NodeGpuRow(Base):
    """One GPU of a node and the run holding it (one column: two holders cannot exist)."""

    __tablename__ = "node_gpus"
    __table_args__ = (
        CheckConstraint("shared_milli >= 0 AND shared_milli <= 1000", name="share_range"),
        CheckConstraint(
            "(shared_milli > 0) = (COALESCE(holder_run_id, '') = '*shared')", name="share_holder"
        ),
    )

    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(128))
    gpu_type: Mapped[str] = mapped_column(String(64))
    memory_mb: Mapped[int] = mapped_column(Integer)
    holder_run_id: Mapped[str | None] = mapped_column(String(40))
    """The run holding the GPU whole, ``domain.types.SHARED_GPU_HOLDER`` while share
    reservations hold it, NULL when free (migration 0012_frac27)."""
    shared_milli: Mapped[int] = mapped_column(Integer, server_default="0", default=0)
    """Thousandths of the GPU its share reservations hold together (0..1000; > 0 exactly
    when the holder is the share holder): the database's per-GPU share sum."""


class GpuHoldRow(Base):
    """GPUs of a node promised to one pending job after a preemption decision: while victims
    stop, the freed GPUs are visible to that job only. Deleted when the job is placed or
    leaves the queue, or when the policy releases the hold."""

    __tablename__ = "gpu_holds"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), primary_key=True)
    """A gang preemptor may hold GPUs on several nodes: one row per (job_id, node_id)."""
    gpu_count: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(16))
    since: Mapped[datetime]


class LeaderLeaseRow(Base):
    __tablename__ = "leader_lease"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    epoch: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[datetime]


class ChangeSeqCounterRow(Base):
    """SQLite only: the last ``change_seq`` handed out by the triggers of migration 0006s
    (one row, id 1). PostgreSQL uses transaction ids instead and leaves it empty."""

    __tablename__ = "change_seq_counter"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)


class SchedulingEventRow(Base):
    """Append-only audit: every state transition and scheduling decision, with its reason."""

    __tablename__ = "scheduling_events"
    __table_args__ = (Index("ix_scheduling_events_job", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(32))
    """transition | placed | skipped | preempt | reconcile | ..."""
    machine: Mapped[str | None] = mapped_column(String(16))
    entity_id: Mapped[str | None] = mapped_column(String(128))
    from_status: Mapped[str | None] = mapped_column(String(24))
    to_status: Mapped[str | None] = mapped_column(String(24))
    trigger: Mapped[str | None] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(String(40))
    run_id: Mapped[str | None] = mapped_column(String(40))
    node_id: Mapped[str | None] = mapped_column(String(128))
    message: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class UsageRecordRow(Base):
    """Accounting: one durable row per ended attempt member (one ``job_runs`` row), written by
    ``store.accounting`` in the transaction that ends it (``store/transitions.py``). Never
    decayed, never updated: what a manager bills on (Slurm's sacct/sreport), unlike the
    decayed fair-share usage on ``teams.usage_gpu_s``."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_end_at", "end_at"),
        Index("ix_usage_records_team_end_at", "team_id", "end_at"),
    )

    run_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    """The attempt (``job_runs.id``); one record per run row, so a gang has one per member."""
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    team_id: Mapped[str] = mapped_column(String(64))
    token_id: Mapped[str | None] = mapped_column(String(64))
    """The API token that submitted the job (None: unknown)."""
    user: Mapped[str] = mapped_column(String(128), default="")
    """The token's owner name (its ``name``, else its id; "" when unknown)."""
    node_id: Mapped[str] = mapped_column(String(128))
    gpu_type: Mapped[str] = mapped_column(String(64))
    gpus: Mapped[int] = mapped_column(Integer)
    start_at: Mapped[datetime]
    """When the GPUs were reserved for the attempt (the allocation's start)."""
    end_at: Mapped[datetime]
    """When the attempt ended (its terminal transition)."""
    gpu_seconds: Mapped[float] = mapped_column(Float)
    """``(end_at - start_at) * gpus`` in GPU-seconds (never negative)."""
    outcome: Mapped[str] = mapped_column(String(16))
    """The attempt's terminal status: SUCCEEDED, FAILED, CANCELLED, PREEMPTED or FENCED."""
    peak_rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Peak memory of the attempt's cgroup, bytes (``memory.peak`` on cgroup v2,
    ``memory.max_usage_in_bytes`` on v1), as its agent reported it; NULL = not measured."""
    cpu_seconds: Mapped[float | None] = mapped_column(Float)
    """CPU time of the attempt's cgroup (user + system), seconds; NULL = not measured."""
    gpu_util_pct: Mapped[float | None] = mapped_column(Float)
    """Mean GPU utilization over the agent's NVML samples of the attempt's GPUs, percent;
    NULL = no NVML on the node (or no sample)."""
    gpu_mem_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Highest GPU memory used on the attempt's GPUs (summed over them) in the samples,
    bytes; NULL = not measured."""

    priority: Mapped[str | None] = mapped_column(String(16), default=None)
    """The class the attempt is charged to (the run's ``priority``, else its job's; migration
    0011e; None for older records): what a team's class budgets count."""


class NotifyOutboxRow(Base):
    """A job's end to tell its webhooks: one row per finished job with ``notify_urls``,
    written in the transaction that makes it terminal (``store/transitions.py``) and
    delivered after commit by ``services.notify`` (the API server's worker), so a slow or
    dead webhook never holds up the completion. Migration 0011b."""

    __tablename__ = "notify_outbox"
    __table_args__ = (Index("ix_notify_outbox_due", "delivered_at", "next_at"),)

    job_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(String(64))
    urls: Mapped[list[str]]
    """The URLs still to deliver to (each removed once it answered 2xx)."""
    status: Mapped[str] = mapped_column(String(24))
    """The job's terminal status at the time of the row."""
    attempts: Mapped[int] = mapped_column(Integer)
    """Delivery rounds made so far."""
    next_at: Mapped[datetime]
    """Not tried again before this time (exponential backoff); also a claim's lease."""
    created_at: Mapped[datetime]
    delivered_at: Mapped[datetime | None]
    """Set when every URL answered 2xx, or when the attempts ran out (``gave_up``)."""
    gave_up: Mapped[bool] = mapped_column(Boolean)
    last_error: Mapped[str | None] = mapped_column(Text)
