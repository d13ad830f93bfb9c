"""change_seq: a change sequence on the rows the scheduler's snapshot is built from

Revision ID: 0006s
Revises: 0005g
Create Date: 2026-11-30 20:00:00

``jobs``, ``job_runs``, ``reservations``, ``nodes`` and ``node_capacity`` get an indexed
``change_seq`` that a database trigger sets on every insert and on every update of a column the
scheduler's snapshot reads (``store.snapshot_cache``), whoever the writer is:

- PostgreSQL: the writing transaction's 64-bit id (``pg_current_xact_id()``). A reader that
  kept the ``xmin`` of its previous snapshot reads every row committed since then with
  ``change_seq >= xmin`` (transaction ids are assigned before commit, so a plain counter
  would let a slow transaction commit a lower number after a reader moved past it).
- SQLite: the next value of a counter (one row in ``change_seq_counter``, shared by the
  tables; writers are serialized, so the order of numbers is the order of commits, and
  unlike a table's largest value it never goes back when a row is deleted).

The columns the triggers watch are listed in ``WATCHED`` (as of this revision; a later one
may watch more, and ``store.snapshot_cache.WATCHED`` equals the newest list, which a test
checks).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006s"
down_revision: str | None = "0006f"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WATCHED: dict[str, tuple[str, ...]] = {
    "jobs": (
        "status",
        "cancel_requested",
        "retry_after",
        "priority",
        "queued_at",
        "attempts",
        "max_runtime_s",
        "team_id",
        "created_at",
    ),
    "job_runs": (
        "status",
        "node_id",
        "gpu_ids",
        "started_at",
        "created_at",
        "preempted_for_job_id",
        "rank",
        "gang_size",
    ),
    "reservations": ("status", "created_at", "run_id"),
    "nodes": (
        "status",
        "gpu_type",
        "gpu_memory_mb",
        "cpu",
        "memory_mb",
        "labels",
        "admin_labels",
        "images",
    ),
    "node_capacity": ("total_gpus", "available_gpus"),
}
JSON_COLUMNS = {"gpu_ids", "labels", "admin_labels", "images", "spec"}
"""Columns PostgreSQL compares as text (``json`` has no equality); ``spec`` is watched from
0012_day26 on."""


def upgrade() -> None:
    op.create_table(
        "change_seq_counter",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_change_seq_counter")),
    )
    for table in WATCHED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("change_seq", sa.BigInteger(), nullable=False, server_default="0")
            )
            batch_op.create_index(f"ix_{table}_change_seq", ["change_seq"])
    if op.get_bind().dialect.name == "postgresql":
        _postgresql_triggers()
    else:
        _sqlite_triggers()


def _postgresql_triggers() -> None:
    op.execute(
        """
        CREATE FUNCTION gpufleet_change_seq() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            NEW.change_seq := pg_current_xact_id()::text::bigint;
            RETURN NEW;
        END $$
        """
    )
    for table, columns in WATCHED.items():
        op.execute(
            f"CREATE TRIGGER {table}_change_seq_ins BEFORE INSERT ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION gpufleet_change_seq()"
        )
        op.execute(update_trigger_sql(table, columns, postgresql=True))


def _sqlite_bump(table: str) -> str:
    return (
        "INSERT INTO change_seq_counter (id, seq) VALUES (1, 1) "
        "ON CONFLICT (id) DO UPDATE SET seq = seq + 1; "
        f"UPDATE {table} SET change_seq = "
        "(SELECT seq FROM change_seq_counter WHERE id = 1) WHERE rowid = NEW.rowid;"
    )


def update_trigger_sql(table: str, columns: tuple[str, ...], *, postgresql: bool) -> str:
    """The CREATE TRIGGER statement of ``{table}_change_seq_upd``, watching ``columns`` (a
    later migration that watches another column drops the trigger and creates it again)."""
    if postgresql:
        changed = " OR ".join(
            f"OLD.{c}::text IS DISTINCT FROM NEW.{c}::text"
            if c in JSON_COLUMNS
            else f"OLD.{c} IS DISTINCT FROM NEW.{c}"
            for c in columns
        )
        return (
            f"CREATE TRIGGER {table}_change_seq_upd BEFORE UPDATE ON {table} "
            f"FOR EACH ROW WHEN ({changed}) EXECUTE FUNCTION gpufleet_change_seq()"
        )
    changed = " OR ".join(f"OLD.{c} IS NOT NEW.{c}" for c in columns)
    return (
        f"CREATE TRIGGER {table}_change_seq_upd AFTER UPDATE ON {table} "
        f"FOR EACH ROW WHEN {changed} BEGIN {_sqlite_bump(table)} END"
    )


def _sqlite_triggers() -> None:
    for table, columns in WATCHED.items():
        op.execute(
            f"CREATE TRIGGER {table}_change_seq_ins AFTER INSERT ON {table} "
            f"FOR EACH ROW BEGIN {_sqlite_bump(table)} END"
        )
        op.execute(update_trigger_sql(table, columns, postgresql=False))


def downgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    for table in WATCHED:
        for name in (f"{table}_change_seq_ins", f"{table}_change_seq_upd"):
            op.execute(f"DROP TRIGGER IF EXISTS {name}" + (f" ON {table}" if postgresql else ""))
    if postgresql:
        op.execute("DROP FUNCTION IF EXISTS gpufleet_change_seq()")
    for table in WATCHED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(f"ix_{table}_change_seq")
            batch_op.drop_column("change_seq")
    op.drop_table("change_seq_counter")
