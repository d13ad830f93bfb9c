"""team submit rate limit columns

Revision ID: 0004e
Revises: 0004d
Create Date: 2026-11-30 13:40:00

``teams.submit_rate_per_s`` and ``teams.submit_burst``: a team's own token bucket for
``POST /v1/jobs`` (NULL = the server's default). ``max_outstanding_jobs`` keeps its column;
from here NULL means the server's default and 0 means no limit.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004e"
down_revision: str | None = "0004d"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("teams", schema=None) as batch_op:
        batch_op.add_column(sa.Column("submit_rate_per_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("submit_burst", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("teams", schema=None) as batch_op:
        batch_op.drop_column("submit_burst")
        batch_op.drop_column("submit_rate_per_s")
