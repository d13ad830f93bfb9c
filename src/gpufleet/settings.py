"""One typed configuration object, read from ``GPUFLEET_*`` environment variables.

Built once in each entrypoint (CLI command) and passed down; nothing else reads the
environment.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLEET_", extra="ignore")

    data_dir: Path = Field(default=Path("~/.gpufleet"), description="Embedded state lives here.")
    database_url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy URL; default sqlite:///{data_dir}/gpufleet.db. "
        "PostgreSQL: postgresql+psycopg://user@host:5432/db",
    )
    redis_url: str | None = Field(
        default=None, description="redis://host:6379/0; None = in-process wake-ups."
    )
    object_store_url: str | None = Field(
        default=None, description="default file://{data_dir}/objects"
    )

    server_host: str = "127.0.0.1"
    server_port: int = 8420
    controller_address: str = Field(
        default="127.0.0.1:8421", description="gRPC host:port of the controller."
    )

    join_address: str | None = Field(
        default=None,
        description="gRPC host:port of the controller's join service (the one port that takes "
        "calls without a client certificate: Join only); default: the controller's host, "
        "port + 1.",
    )
    pki_dir: Path | None = Field(
        default=None, description="Fleet CA (ca.key, ca.crt); default {data_dir}/pki."
    )
    tls_hostnames: str = Field(
        default="",
        description="Comma-separated extra names/IPs in the controller certificate (loopback "
        "and controller.gpufleet are always there).",
    )
    node_cert_ttl_s: float = Field(
        default=30 * 86400, description="Lifetime of node certificates; renewed at 2/3."
    )

    agent_labels: str = Field(
        default="",
        description="Labels the agent reports for its node, e.g. 'rack=r1,switch=s3' (commas"
        " or spaces between items; Kubernetes label syntax); `gpufleet agent --label` flags win"
        " on a shared key. The gang scheduler prefers nodes of one rack/switch.",
    )

    allowed_mounts: str = Field(
        default="",
        description="Comma-separated host paths (and what is under them) a container job may"
        " mount (--mount SRC:DST); a submit with another source is refused (422, naming"
        " mounts[i].source). Empty: no fleet-level list (each agent's --allow-mount decides;"
        " an agent allows none by default).",
    )
    notify_allow_hosts: str = Field(
        default="",
        description="Comma-separated host names or IP addresses completion webhooks may be"
        " delivered to; empty: any host whose addresses are all public.",
    )
    notify_allow_private: bool = Field(
        default=False,
        description="Deliver webhooks to loopback, link-local, private and other non-public"
        " addresses too (tests, an on-premises receiver); off: refused unless the host is in"
        " notify_allow_hosts.",
    )
    notify_max_attempts: int = Field(
        default=8, ge=1, le=100, description="Delivery rounds of one webhook before giving up."
    )
    notify_backoff_s: float = Field(
        default=2.0,
        gt=0,
        description="First retry delay of a failed webhook, seconds; doubled each round"
        " (capped at 1 hour).",
    )
    notify_timeout_s: float = Field(default=5.0, gt=0, description="One delivery's timeout.")

    heartbeat_interval_s: float = 10.0
    suspect_after_missed: int = Field(default=3, description="Missed heartbeats before SUSPECT.")
    confirm_timeout_s: float = Field(default=30.0, description="RESERVED this long -> reconcile.")
    fence_timeout_s: float = Field(
        default=60.0,
        description="A node silent this long is fenced: its attempts FENCED and re-placed, its"
        " GPUs QUARANTINED until the agent reports the runs gone or an operator fences it.",
    )
    retry_backoff_s: float = Field(
        default=10.0,
        description="Backoff before a failed job's next attempt: retry_backoff_s x 2^(n-1)"
        " after its n-th failure, times a jitter in [0.5, 1], capped at retry_backoff_cap_s.",
    )
    retry_backoff_cap_s: float = Field(default=300.0, description="Cap of the retry backoff.")
    max_node_failures: int = Field(
        default=3,
        description="Attempts a job may lose to its node (node fenced, node-caused start"
        " failure) before it fails; separate from the job's own max_retries.",
    )
    scheduler_tick_s: float = Field(
        default=1.0, description="Scheduler pass period without wake-ups."
    )
    scheduler_full_snapshot_every_s: float = Field(
        default=60.0,
        gt=0,
        description="The leader reads only changed rows between passes; at least this often"
        " (seconds) it reads everything again, a safety net (store.snapshot_cache).",
    )
    default_grace_s: float = Field(default=30.0, description="SIGTERM -> SIGKILL grace for stops.")
    preemption_waste_gpu_h: float | None = Field(
        default=None,
        ge=0,
        description="Fleet-wide cap on the GPU-hours of work preemption may lose (GPUs x time"
        " since the victims' last checkpoints) per preemption_waste_window_s; unset = unlimited.",
    )
    preemption_waste_window_s: float = Field(
        default=86400.0, gt=0, description="Rolling window of the preemption waste cap, seconds."
    )
    agent_disk_reserve_mb: int = Field(
        default=1024,
        description="An agent whose state or scratch directory has less free space (MiB)"
        " refuses new work and reports itself UNHEALTHY (0 = no check).",
    )
    leader_lease_s: float = 15.0
    reservation_lease_s: float = 60.0

    max_env_bytes: int = Field(default=64 * 1024, description="Total size of a job's env, bytes.")
    max_gpus_per_node: int = Field(
        default=8, description="gpu_count bound while no node is registered."
    )
    gpu_fraction_steps: int = Field(
        default=8,
        ge=1,
        le=1000,
        description="A job's gpu_fraction must be a multiple of 1/N of a GPU (8: eighths);"
        " N must divide 1000 (shares are summed in thousandths of a GPU).",
    )

    @field_validator("gpu_fraction_steps")
    @classmethod
    def _steps_divide_milli(cls, v: int) -> int:
        if 1000 % v:
            raise ValueError(f"gpu_fraction_steps {v} does not divide 1000 (e.g. 2, 4, 8, 10)")
        return v

    team_max_outstanding_jobs: int = Field(
        default=10_000,
        ge=0,
        description="Unfinished jobs a team may have, unless set for the team; 0 = no limit.",
    )
    team_submit_rate_per_s: float = Field(
        default=100.0,
        ge=0,
        allow_inf_nan=False,
        description="POST /v1/jobs per second per team (token bucket refill), unless set for "
        "the team; 0 = no limit.",
    )
    team_submit_burst: int = Field(
        default=500, ge=1, description="Token-bucket size: submits a team may make at once."
    )

    # upgrades (docs/operations/upgrade.md)
    migrate_on_start: bool = Field(
        default=False,
        description="`gpufleet server`/`controller` apply pending migrations before starting"
        " (as --migrate); by default they refuse a schema other than their own and name"
        " `gpufleet admin migrate`.",
    )
    allow_newer_schema: bool = Field(
        default=False,
        description="`gpufleet server`/`controller` start on a schema migrated by a newer"
        " gpufleet (as --allow-newer-schema): the previous release beside the new one while"
        " a rolling upgrade with additive migrations runs.",
    )

    # --- metrics ports (`controller --metrics-port`, `agent --metrics-port`) -------------
    # they name teams (queue depth, allocation), GPU types and node paths: loopback unless
    # the operator says otherwise, and optionally behind basic auth and TLS (metrics_http)
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address the controller's and agents' metrics ports bind (0.0.0.0: all).",
    )
    metrics_basic_auth: SecretStr | None = Field(
        default=None,
        description="Basic auth of the metrics ports: USER:sha256:HEX, USER:file:PATH or "
        "USER:PASSWORD (None: no auth).",
    )
    metrics_tls_cert: Path | None = Field(
        default=None, description="PEM certificate: serve the metrics ports over HTTPS."
    )
    metrics_tls_key: Path | None = Field(default=None, description="Its PEM key.")

    def metrics_basic_auth_value(self) -> str:
        """The raw basic auth setting ("" when none)."""
        return self.metrics_basic_auth.get_secret_value() if self.metrics_basic_auth else ""

    # ---- API edge: HTTP limits, TLS, read rate, Redis (README "Limits", "Security") ----
    server_max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest request head (request line + headers), bytes; over it the"
        " API answers 431 and closes the connection.",
    )
    server_max_headers: int = Field(
        default=100, ge=8, description="Most header fields in one request (431 over it)."
    )
    server_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request's head must arrive within this many seconds of the connection"
        " opening or of the previous answer (slow or silent clients are closed).",
    )
    server_keepalive_timeout_s: float = Field(
        default=5.0, gt=0, description="An idle keep-alive connection is closed after this."
    )
    server_max_connections: int = Field(
        default=2048,
        ge=1,
        description="Open connections and requests in progress per API process (uvicorn"
        " limit_concurrency); over it new requests get 503.",
    )
    server_max_connections_per_ip: int = Field(
        default=256,
        ge=0,
        description="Open connections from one client address, counted before any"
        " authentication; more are closed at once (0 = no cap; behind a proxy every client"
        " has the proxy's address: raise it or set 0 and cap at the proxy).",
    )
    server_tls_cert: Path | None = Field(
        default=None, description="PEM certificate (chain) of the API; with server_tls_key."
    )
    server_tls_key: Path | None = Field(default=None, description="PEM private key of the API.")
    server_forwarded_allow_ips: str = Field(
        default="127.0.0.1",
        description="Comma-separated proxy addresses (or '*') whose X-Forwarded-For/-Proto"
        " the API trusts (client address, https for the Secure cookie).",
    )
    team_read_rate_per_s: float = Field(
        default=20.0,
        ge=0,
        allow_inf_nan=False,
        description="Read tokens per second per team (every GET of /v1 takes 1; a job list 1"
        " per 20 rows it asks for: 3 for the default 50, 25 for 500), unless set for the team;"
        " 0 = no limit.",
    )
    team_read_burst: int = Field(
        default=100, ge=1, description="Read token-bucket size: read tokens a team has at once."
    )
    team_list_concurrency: int = Field(
        default=2,
        ge=0,
        description="Job lists (GET /v1/jobs) of one team served at once per API process;"
        " more wait their turn (0 = no cap).",
    )
    redis_prefix: str = Field(
        default="gpufleet",
        pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
        description="Namespace of this deployment's Redis keys and channels ({prefix}:wake,"
        " {prefix}:rate:...); give each deployment sharing a Redis its own.",
    )
    redis_timeout_s: float = Field(
        default=0.25,
        gt=0,
        le=10,
        description="Timeout of each Redis call; the first failure skips Redis for 10 s.",
    )

    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()

    def private_data_dir(self) -> Path:
        """The data dir, created if missing and made mode 0700 when this user owns it: it
        holds the SQLite database, the client config with the admin token, the local object
        store (every team's artifacts) and agent state, none of which a job may read (jobs run
        as other users)."""
        path = self.resolved_data_dir()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_uid == os.geteuid():
            path.chmod(0o700)
        return path

    def resolved_database_url(self) -> str:
        if self.database_url is not None:
            return self.database_url.get_secret_value()
        return f"sqlite:///{self.resolved_data_dir() / 'gpufleet.db'}"

    def resolved_pki_dir(self) -> Path:
        return (self.pki_dir or self.resolved_data_dir() / "pki").expanduser().resolve()

    def resolved_join_address(self) -> str:
        if self.join_address:
            return self.join_address
        host, _, port = self.controller_address.rpartition(":")
        return f"{host}:{int(port) + 1 if port.isdigit() and int(port) else 0}"

    def tls_hostname_list(self) -> list[str]:
        return [h.strip() for h in self.tls_hostnames.split(",") if h.strip()]

    def resolved_object_store_url(self) -> str:
        return self.object_store_url or f"file://{self.resolved_data_dir() / 'objects'}"

    def allowed_mount_list(self) -> tuple[str, ...] | None:
        """:attr:`allowed_mounts` as normalized paths; None when it is empty (no list)."""
        raw = [p.strip() for p in self.allowed_mounts.split(",")]
        items = tuple(p.rstrip("/") or "/" for p in raw if p)
        return items or None
