"""job data and results: completion webhooks (an outbox, per-team signing secrets and default
URLs) and per-attempt resource figures on the usage records

Revision ID: 0011b
Revises: 0011a
Create Date: 2026-12-03 10:00:00

- ``notify_outbox``: one row per finished job that has webhooks, written in the transaction
  that makes the job terminal and delivered after commit (``services.notify``).
- ``jobs.notify_urls``: the job's webhooks (its own ``notify``, else its team's defaults at
  submit); NULL = none.
- ``teams.notify_secret`` (the HMAC key of the team's webhooks) and ``teams.notify_urls``
  (the team's default webhooks).
- ``usage_records.peak_rss_bytes``, ``cpu_seconds``, ``gpu_util_pct``,
  ``gpu_mem_peak_bytes``: what the agent measured of the attempt (NULL = not measured). On
  SQLite the ``insert_rows`` view and its trigger (0007a) are created again with them (the
  view must cover every column of the tables it writes).

Job mounts and ``shm_size_mb`` live in the job's JSON spec: no column.
"""

from collections.abc import Sequence
from importlib import import_module

import sqlalchemy as sa
from alembic import op

revision: str = "0011b"
down_revision: str | None = "0011a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_insert_rows = import_module(
    "gpufleet.store.migrations.versions.0007a_sqlite_one_statement_writes"
)
_previous = import_module("gpufleet.store.migrations.versions.0008c_run_last_checkpoint")

USAGE_COLUMNS = ("peak_rss_bytes", "cpu_seconds", "gpu_util_pct", "gpu_mem_peak_bytes")

INSERT_COLUMNS: dict[str, tuple[str, ...]] = {
    **_previous.INSERT_COLUMNS,
    "usage_records": (*_previous.INSERT_COLUMNS["usage_records"], *USAGE_COLUMNS),
}
"""The columns of SQLite's ``insert_rows`` view, per table, as of this revision."""


def upgrade() -> None:
    op.create_table(
        "notify_outbox",
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("team_id", sa.String(64), nullable=False),
        sa.Column("urls", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(24), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("gave_up", sa.Boolean(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_notify_outbox")),
    )
    op.create_index(
        "ix_notify_outbox_due", "notify_outbox", ["delivered_at", "next_at"], unique=False
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:  # add_column: no rebuild
        batch_op.add_column(sa.Column("notify_urls", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("teams", schema=None) as batch_op:
        batch_op.add_column(sa.Column("notify_secret", sa.String(128), nullable=True))
        batch_op.add_column(sa.Column("notify_urls", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("peak_rss_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("cpu_seconds", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("gpu_util_pct", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("gpu_mem_peak_bytes", sa.BigInteger(), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        _insert_rows.drop_insert_rows()
        _insert_rows.create_insert_rows(INSERT_COLUMNS)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:  # SQLite refuses to drop a column a view or trigger names
        _insert_rows.drop_insert_rows()
    # not batch_alter_table: on SQLite its drop_column rebuilds the table (and drops triggers)
    for column in USAGE_COLUMNS:
        op.drop_column("usage_records", column)
    op.drop_column("teams", "notify_urls")
    op.drop_column("teams", "notify_secret")
    op.drop_column("jobs", "notify_urls")
    op.drop_index("ix_notify_outbox_due", table_name="notify_outbox")
    op.drop_table("notify_outbox")
    if sqlite:
        _insert_rows.create_insert_rows(_previous.INSERT_COLUMNS)
