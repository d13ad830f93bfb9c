"""gang attempts: one job_runs row per member (rank, gang_size), the rank-0 agent's
MASTER_PORT, the gang attempt's decided outcome, and GPU holds per (job_id, node_id)

Revision ID: 0005g
Revises: 0005u
Create Date: 2026-11-30 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005g"
down_revision: str | None = "0005u"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE_RUN_SQL = "status IN ('ASSIGNED', 'RUNNING', 'PREEMPTING')"


def upgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rank", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(
            sa.Column("gang_size", sa.Integer(), nullable=False, server_default="1")
        )
        batch_op.add_column(sa.Column("master_port", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("gang_outcome", sa.String(length=16), nullable=True))
        batch_op.drop_constraint("uq_job_runs_job_id_attempt", type_="unique")
        batch_op.create_unique_constraint(
            "uq_job_runs_job_id_attempt_rank", ["job_id", "attempt", "rank"]
        )
        batch_op.drop_index("uq_job_runs_one_active_per_job")
        batch_op.create_index(
            "uq_job_runs_one_active_per_rank",
            ["job_id", "rank"],
            unique=True,
            sqlite_where=sa.text(ACTIVE_RUN_SQL),
            postgresql_where=sa.text(ACTIVE_RUN_SQL),
        )
    with op.batch_alter_table("gpu_holds", schema=None) as batch_op:
        batch_op.drop_constraint("pk_gpu_holds", type_="primary")
        batch_op.create_primary_key("pk_gpu_holds", ["job_id", "node_id"])


def downgrade() -> None:
    with op.batch_alter_table("gpu_holds", schema=None) as batch_op:
        batch_op.drop_constraint("pk_gpu_holds", type_="primary")
        batch_op.create_primary_key("pk_gpu_holds", ["job_id"])
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.drop_index("uq_job_runs_one_active_per_rank")
        batch_op.create_index(
            "uq_job_runs_one_active_per_job",
            ["job_id"],
            unique=True,
            sqlite_where=sa.text(ACTIVE_RUN_SQL),
            postgresql_where=sa.text(ACTIVE_RUN_SQL),
        )
        batch_op.drop_constraint("uq_job_runs_job_id_attempt_rank", type_="unique")
        batch_op.create_unique_constraint("uq_job_runs_job_id_attempt", ["job_id", "attempt"])
        batch_op.drop_column("gang_outcome")
        batch_op.drop_column("master_port")
        batch_op.drop_column("gang_size")
        batch_op.drop_column("rank")
