"""team read rate limit columns

Revision ID: 0009d
Revises: 0008c
Create Date: 2026-12-02 04:50:00

``teams.read_rate_per_s`` and ``teams.read_burst``: a team's own token bucket for the API's
reads (GET; NULL = the server's default, 0 = no limit). ``teams`` has no change_seq trigger
and no SQLite view, so adding columns needs nothing else.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009d"
down_revision: str | None = "0008c"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("teams", schema=None) as batch_op:
        batch_op.add_column(sa.Column("read_rate_per_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("read_burst", sa.Integer(), nullable=True))


def downgrade() -> None:
    # not batch_alter_table: on SQLite its drop_column rebuilds ``teams``, and dropping the old
    # table fails the foreign keys that point at it (SQLite >= 3.35 drops a column in place)
    op.drop_column("teams", "read_burst")
    op.drop_column("teams", "read_rate_per_s")
