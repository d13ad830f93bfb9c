"""GPU shares (issue 27): several reservations of fractions of one GPU

Revision ID: 0012_frac27
Revises: 0012_day26
Create Date: 2026-12-04 19:00:00

* ``node_gpus.shared_milli`` (thousandths of the GPU held by share reservations, 0..1000):
  the per-GPU share sum. A share reservation adds its part with ONE guarded UPDATE of the GPU
  row (``shared_milli + :m <= 1000``), which also sets ``holder_run_id`` to
  ``domain.types.SHARED_GPU_HOLDER`` on the first share; the last share's release sets it
  back to NULL. The database itself guarantees per GPU that the shares sum to at most one
  GPU (``CHECK shared_milli BETWEEN 0 AND 1000``) and that a GPU holds shares exactly when
  its holder is the share holder (``CHECK``), so a whole-GPU claim (``holder_run_id IS
  NULL``) never lands on a GPU with shares, nor a share on a GPU held whole. The SQLite
  capacity trigger (0007a) watches ``holder_run_id``, so a GPU taken by its first share
  leaves ``available_gpus`` and comes back with its last share's release, as a whole GPU's;
  PostgreSQL moves the capacity row explicitly (``store.allocate``).
* ``reservations.gpu_milli`` (0 = whole GPUs): the share a reservation holds of its one GPU
  (``gpu_ids`` names it; ``gpu_count`` is 0: it holds no whole GPU).
* ``nodes.gpu_sharing`` (``none``/``timeslice``/``mps``, default ``none``): whether and how
  the node's GPUs may be shared, as its agent reported at registration.

Both are plain ``ALTER TABLE ... ADD COLUMN`` (no rebuild: SQLite would drop the tables'
change_seq and capacity triggers). On SQLite the checks are column constraints of the new
column (SQLite cannot add a table constraint); on PostgreSQL named table constraints. The
``insert_rows`` view (0007a) is created again with ``reservations.gpu_milli``.
"""

from collections.abc import Sequence
from importlib import import_module

import sqlalchemy as sa
from alembic import op

revision: str = "0012_frac27"
down_revision: str | None = "0012_day26"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_insert_rows = import_module(
    "gpufleet.store.migrations.versions.0007a_sqlite_one_statement_writes"
)
_previous = import_module("gpufleet.store.migrations.versions.0011e_team_limits")

INSERT_COLUMNS: dict[str, tuple[str, ...]] = {
    **_previous.INSERT_COLUMNS,
    "reservations": (*_previous.INSERT_COLUMNS["reservations"], "gpu_milli"),
}
"""The columns of SQLite's ``insert_rows`` view, per table, as of this revision."""

SHARE_RANGE = "shared_milli >= 0 AND shared_milli <= 1000"
SHARE_HOLDER = "(shared_milli > 0) = (COALESCE(holder_run_id, '') = '*shared')"


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute(
            "ALTER TABLE node_gpus ADD COLUMN shared_milli INTEGER NOT NULL DEFAULT 0"
            f" CONSTRAINT ck_node_gpus_share_range CHECK ({SHARE_RANGE})"
            f" CONSTRAINT ck_node_gpus_share_holder CHECK ({SHARE_HOLDER})"
        )
    else:
        op.add_column(
            "node_gpus",
            sa.Column("shared_milli", sa.Integer(), nullable=False, server_default="0"),
        )
        op.create_check_constraint("ck_node_gpus_share_range", "node_gpus", SHARE_RANGE)
        op.create_check_constraint("ck_node_gpus_share_holder", "node_gpus", SHARE_HOLDER)
    op.add_column(
        "reservations",
        sa.Column("gpu_milli", sa.Integer(), nullable=False, server_default="0"),
    )
    op.add_column(
        "nodes",
        sa.Column("gpu_sharing", sa.String(16), nullable=False, server_default="none"),
    )
    if sqlite:
        _insert_rows.drop_insert_rows()
        _insert_rows.create_insert_rows(INSERT_COLUMNS)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:  # SQLite refuses to drop a column a view or trigger names
        _insert_rows.drop_insert_rows()
    else:
        op.drop_constraint("ck_node_gpus_share_holder", "node_gpus", type_="check")
        op.drop_constraint("ck_node_gpus_share_range", "node_gpus", type_="check")
    op.drop_column("nodes", "gpu_sharing")
    op.drop_column("reservations", "gpu_milli")
    op.drop_column("node_gpus", "shared_milli")
    if sqlite:
        _insert_rows.create_insert_rows(_previous.INSERT_COLUMNS)
