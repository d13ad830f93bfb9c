"""a node's pending inventory change as columns: what its agent last reported when that
differs from the recorded GPUs (the node drained for it), instead of a marker at the end of
``status_reason``

Revision ID: 0007i
Revises: 0007a
Create Date: 2026-12-01 12:00:00

``nodes.reported_gpus`` and ``nodes.reported_gpu_type``: both NULL (no pending change) or both
set (``services.nodes``). A database upgraded with a node in such a drain keeps the drain but
not the refusal of its uncordon: the reason text was never parsed into the columns (a drain is
short, and the node's next registration ends it as before).

Both steps are one ``ALTER TABLE`` on SQLite (>= 3.35) as on PostgreSQL, so the table is not
rebuilt: a rebuild would drop ``nodes``' change_seq triggers (0006s).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007i"
down_revision: str | None = "0007a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:  # add_column: no rebuild
        batch_op.add_column(sa.Column("reported_gpus", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("reported_gpu_type", sa.String(length=64), nullable=True))


def downgrade() -> None:
    # not batch_alter_table: on SQLite its drop_column rebuilds the table (and drops triggers)
    op.drop_column("nodes", "reported_gpu_type")
    op.drop_column("nodes", "reported_gpus")
