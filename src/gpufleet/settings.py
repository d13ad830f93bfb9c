"""One typed configuration object, read from ``GPUFLEET_*`` environment variables.

Built once in each entrypoint (CLI command) and passed down; nothing else reads the
environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
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

    heartbeat_interval_s: float = 10.0
    suspect_after_missed: int = Field(default=3, description="Missed heartbeats before SUSPECT.")
    confirm_timeout_s: float = Field(default=30.0, description="RESERVED this long -> reconcile.")
    scheduler_tick_s: float = Field(
        default=1.0, description="Scheduler pass period without wake-ups."
    )
    default_grace_s: float = Field(default=30.0, description="SIGTERM -> SIGKILL grace for stops.")
    leader_lease_s: float = 15.0
    reservation_lease_s: float = 60.0

    max_env_bytes: int = Field(default=64 * 1024, description="Total size of a job's env, bytes.")
    max_gpus_per_node: int = Field(
        default=8, description="gpu_count bound while no node is registered."
    )

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

    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()

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
