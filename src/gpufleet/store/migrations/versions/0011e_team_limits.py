"""team limits: allowed priority classes, class budgets, GPU-hour budgets (issue 28)

Revision ID: 0011e
Revises: 0010g
Create Date: 2026-12-03 12:30:00

* ``teams.limits`` (JSON, NULL = none): the team's ``policy.limits.TeamLimits`` as
  ``services.team_limits`` validates and stores it;
* ``job_runs.priority`` (NULL = its job's class): the class an attempt was placed at when a
  limit demoted it (what preemption sees and what its GPU-time is charged to);
* ``usage_records.priority``: the class an ended attempt is charged to (NULL for records
  written before this migration: charged to no class budget). The per-window aggregates of
  ``store.team_limits`` read ``ix_usage_records_team_end_at``.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011e"
down_revision: str | None = "0010g"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMN (no batch rebuild: SQLite would drop the tables' change_seq triggers)
    op.add_column("teams", sa.Column("limits", sa.JSON(), nullable=True))
    op.add_column("job_runs", sa.Column("priority", sa.String(16), nullable=True))
    op.add_column("usage_records", sa.Column("priority", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("usage_records", "priority")
    op.drop_column("job_runs", "priority")
    op.drop_column("teams", "limits")
