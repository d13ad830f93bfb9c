"""node recovery: node status reason and health, attempt blame, retry backoff

Revision ID: 0004d
Revises: 0004a
Create Date: 2026-11-30 13:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004d"
down_revision: str | None = "0004a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("status_reason", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("health", sa.JSON(), nullable=True))
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("charged_to", sa.String(length=8), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retry_after", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("retry_after")
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.drop_column("charged_to")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("health")
        batch_op.drop_column("status_reason")
