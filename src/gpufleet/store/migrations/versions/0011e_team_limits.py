"""team limits: allowed priority classes, class budgets, GPU-hour budgets (issue 28)

Revision ID: 0011e
Revises: 0011b
Create Date: 2026-12-03 12:30:00

* ``teams.limits`` (JSON, NULL = none): the team's ``policy.limits.TeamLimits`` as
  ``services.team_limits`` validates and stores it;
* ``job_runs.priority`` (NULL = its job's class): the class an attempt was placed at when a
  limit demoted it (what preemption sees and what its GPU-time is charged to);
* ``usage_records.priority``: the class an ended attempt is charged to (NULL for records
  written before this migration: charged to no class budget). The per-window aggregates of
  ``store.team_limits`` read ``ix_usage_records_team_end_at``.

On SQLite the ``insert_rows`` view and its trigger (0007a) are created again with the two new
columns (the view must cover every column of the tables it writes). ``job_runs.priority`` is
written only by the insert, so no change_seq trigger watches it (an insert bumps anyway).
"""

from collections.abc import Sequence
from importlib import import_module

import sqlalchemy as sa
from alembic import op

revision: str = "0011e"
down_revision: str | None = "0011b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


_insert_rows = import_module(
    "gpufleet.store.migrations.versions.0007a_sqlite_one_statement_writes"
)
_previous = import_module("gpufleet.store.migrations.versions.0011b_job_data")

INSERT_COLUMNS: dict[str, tuple[str, ...]] = {
    **_previous.INSERT_COLUMNS,
    "job_runs": (*_previous.INSERT_COLUMNS["job_runs"], "priority"),
    "usage_records": (*_previous.INSERT_COLUMNS["usage_records"], "priority"),
}
"""The columns of SQLite's ``insert_rows`` view, per table, as of this revision."""


def upgrade() -> None:
    # plain ADD COLUMN (no batch rebuild: SQLite would drop the tables' change_seq triggers)
    op.add_column("teams", sa.Column("limits", sa.JSON(), nullable=True))
    op.add_column("job_runs", sa.Column("priority", sa.String(16), nullable=True))
    op.add_column("usage_records", sa.Column("priority", sa.String(16), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        _insert_rows.drop_insert_rows()
        _insert_rows.create_insert_rows(INSERT_COLUMNS)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:  # SQLite refuses to drop a column a view or trigger names
        _insert_rows.drop_insert_rows()
    op.drop_column("usage_records", "priority")
    op.drop_column("job_runs", "priority")
    op.drop_column("teams", "limits")
    if sqlite:
        _insert_rows.create_insert_rows(_previous.INSERT_COLUMNS)
