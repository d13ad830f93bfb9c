"""container runtime: start phases on attempts, local images and pre-pulls on nodes

Revision ID: 0004c
Revises: 0004e
Create Date: 2026-11-30 13:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004c"
down_revision: str | None = "0004e"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("start_phases", sa.JSON(), nullable=True))
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("images", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("prepull", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("prepull")
        batch_op.drop_column("images")
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.drop_column("start_phases")
