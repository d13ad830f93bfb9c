"""job arrays, dependencies and holds

Revision ID: 0005j
Revises: 0004c
Create Date: 2026-11-30 16:30:00

``jobs.held`` (a user's hold), ``jobs.gated`` (the row has a gate the scheduler checks:
held, dependencies or an array's max-running limit), ``jobs.array_id``/``array_index``/
``array_max_running`` (job arrays, ``--array 0-99%8``) and ``jobs.depends_on`` (Slurm-style
``afterok``/``afterany``/``afternotok``). The new terminal job state DEPENDENCY_FAILED is
17 characters: ``jobs.status`` and ``scheduling_events.from_status``/``to_status`` widen from
16 to 24.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005j"
down_revision: str | None = "0005t"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("held", sa.Boolean(), server_default=sa.text("false"), nullable=False)
        )
        batch_op.add_column(
            sa.Column("gated", sa.Boolean(), server_default=sa.text("false"), nullable=False)
        )
        batch_op.add_column(sa.Column("array_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("array_index", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("array_max_running", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("depends_on", sa.JSON(none_as_null=True), nullable=True))
        batch_op.create_index("ix_jobs_status_gated", ["status", "gated"], unique=False)
        batch_op.create_index("ix_jobs_array_id", ["array_id"], unique=False)
        batch_op.create_index("ix_jobs_team_id_name", ["team_id", "name"], unique=False)
        batch_op.alter_column(
            "status", existing_type=sa.String(length=16), type_=sa.String(length=24)
        )
    with op.batch_alter_table("scheduling_events", schema=None) as batch_op:
        for column in ("from_status", "to_status"):
            batch_op.alter_column(
                column,
                existing_type=sa.String(length=16),
                type_=sa.String(length=24),
                existing_nullable=True,
            )


def downgrade() -> None:
    with op.batch_alter_table("scheduling_events", schema=None) as batch_op:
        for column in ("from_status", "to_status"):
            batch_op.alter_column(
                column,
                existing_type=sa.String(length=24),
                type_=sa.String(length=16),
                existing_nullable=True,
            )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column(
            "status", existing_type=sa.String(length=24), type_=sa.String(length=16)
        )
        batch_op.drop_index("ix_jobs_team_id_name")
        batch_op.drop_index("ix_jobs_array_id")
        batch_op.drop_index("ix_jobs_status_gated")
        batch_op.drop_column("depends_on")
        batch_op.drop_column("array_max_running")
        batch_op.drop_column("array_index")
        batch_op.drop_column("array_id")
        batch_op.drop_column("gated")
        batch_op.drop_column("held")
