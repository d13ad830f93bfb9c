"""an attempt's last checkpoint time, as its agent reports it in heartbeats, so that the
scheduler prices a preemption by the work since the last checkpoint, not since the start

Revision ID: 0008c
Revises: 0007i
Create Date: 2026-12-01 22:00:00

``job_runs.last_checkpoint_at`` (NULL: none reported; ``services.node_heartbeat``). The
scheduler's snapshot reads it, so ``job_runs``' change_seq update trigger (0006s) is created
again watching it too (``WATCHED``), and on SQLite the ``insert_rows`` view and its trigger
(0007a) are created again with the new column (the view must cover every column of the
table). The column is one ``ALTER TABLE`` on SQLite (>= 3.35) as on PostgreSQL: ``job_runs``
is not rebuilt, so its other triggers stay.
"""

from collections.abc import Sequence
from importlib import import_module

import sqlalchemy as sa
from alembic import op

revision: str = "0008c"
down_revision: str | None = "0007i"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_change_seq = import_module("gpufleet.store.migrations.versions.0006s_change_seq")
_insert_rows = import_module(
    "gpufleet.store.migrations.versions.0007a_sqlite_one_statement_writes"
)

WATCHED: dict[str, tuple[str, ...]] = {
    **_change_seq.WATCHED,
    "job_runs": (*_change_seq.WATCHED["job_runs"], "last_checkpoint_at"),
}
"""Per table, the columns whose change bumps ``change_seq``, as of this revision."""

INSERT_COLUMNS: dict[str, tuple[str, ...]] = {
    **_insert_rows.INSERT_COLUMNS,
    "job_runs": (*_insert_rows.INSERT_COLUMNS["job_runs"], "last_checkpoint_at"),
}
"""The columns of SQLite's ``insert_rows`` view, per table, as of this revision."""


def _job_runs_update_trigger(watched: dict[str, tuple[str, ...]]) -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    op.execute(
        "DROP TRIGGER IF EXISTS job_runs_change_seq_upd" + (" ON job_runs" if postgresql else "")
    )
    op.execute(
        _change_seq.update_trigger_sql("job_runs", watched["job_runs"], postgresql=postgresql)
    )


def upgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:  # add_column: no rebuild
        batch_op.add_column(
            sa.Column("last_checkpoint_at", sa.DateTime(timezone=True), nullable=True)
        )
    _job_runs_update_trigger(WATCHED)
    if op.get_bind().dialect.name == "sqlite":
        _insert_rows.drop_insert_rows()
        _insert_rows.create_insert_rows(INSERT_COLUMNS)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:  # SQLite refuses to drop a column a view or trigger names
        _insert_rows.drop_insert_rows()
    op.execute(
        "DROP TRIGGER IF EXISTS job_runs_change_seq_upd" + ("" if sqlite else " ON job_runs")
    )
    # not batch_alter_table: on SQLite its drop_column rebuilds the table (and drops triggers)
    op.drop_column("job_runs", "last_checkpoint_at")
    _job_runs_update_trigger(_change_seq.WATCHED)
    if sqlite:
        _insert_rows.create_insert_rows(_insert_rows.INSERT_COLUMNS)
