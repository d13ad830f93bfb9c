"""the policy's ground of a preemption on the stopped run (reclaim, priority, defragment),
so the store can pass recent displacements to the policy (DD7 budget and anti-thrash)

Revision ID: 0006f
Revises: 0005g
Create Date: 2026-11-30 20:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006f"
down_revision: str | None = "0006r"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempt_reason", sa.String(length=16), nullable=True))
        batch_op.create_index("ix_job_runs_stop_requested_at", ["stop_requested_at"])


def downgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_job_runs_stop_requested_at")
        batch_op.drop_column("preempt_reason")
