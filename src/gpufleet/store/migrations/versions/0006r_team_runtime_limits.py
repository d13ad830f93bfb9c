"""team default and maximum run time

Revision ID: 0006r
Revises: 0005g
Create Date: 2026-11-30 20:10:00

``teams.default_max_runtime_s`` and ``teams.max_runtime_limit_s`` (Slurm's DefaultTime and
MaxTime per partition): a job submitted without ``max_runtime_s`` gets the team's default;
one asking for more than the team's maximum is refused (422). NULL = none.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006r"
down_revision: str | None = "0005g"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("teams", schema=None) as batch_op:
        batch_op.add_column(sa.Column("default_max_runtime_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("max_runtime_limit_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("teams", schema=None) as batch_op:
        batch_op.drop_column("max_runtime_limit_s")
        batch_op.drop_column("default_max_runtime_s")
