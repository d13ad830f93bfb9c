"""node labels set by an admin, kept apart from the agent's (issue 9: topology labels)

Revision ID: 0005t
Revises: 0004c
Create Date: 2026-11-30 16:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005t"
down_revision: str | None = "0004c"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("admin_labels", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("admin_labels")
