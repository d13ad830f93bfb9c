"""SQLite: a node's free-GPU count follows its GPU rows (a trigger), so that claiming or
freeing GPUs is ONE statement there, as it is on PostgreSQL (docs/design/allocation.md,
"Statement budget")

Revision ID: 0007a
Revises: 0006s
Create Date: 2026-12-01 09:00:00

``node_gpus_capacity`` (SQLite only): when a GPU row's ``holder_run_id`` goes from NULL to a
run (claimed) or back (freed), the node's ``node_capacity.available_gpus`` moves by one and
its ``version`` by one, in the same statement; a GPU row of a node without a capacity row
aborts the statement. ``CHECK (available_gpus >= 0)`` and ``CHECK (available_gpus <=
total_gpus)`` still bound it. ``store.allocate`` then claims GPUs with one guarded UPDATE of
``node_gpus`` (and frees them with one), which moves the capacity row with it or not at all
(``dialect.capacity_follows_gpu_rows``). PostgreSQL keeps its explicit capacity UPDATE (one
statement already: data-modifying WITH, ``store.reserve_once``), so nothing changes there.

Code before this revision on an upgraded SQLite file would move the capacity twice (its own
UPDATE and the trigger): the process migrates at start, code and schema go together.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007a"
down_revision: str | None = "0006s"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CAPACITY_TRIGGER = "node_gpus_capacity"
"""The trigger's name. A later migration that rebuilds ``node_gpus`` on SQLite
(``batch_alter_table``) drops it and must create it again; without it the capacity would stop
following the GPU rows, which the invariant check (reserved + available = total) reports
after the next reservation. No GPU can go to two runs either way: the claim is guarded on the
GPU rows themselves (``holder_run_id IS NULL``)."""


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    op.execute(
        f"""
        CREATE TRIGGER {CAPACITY_TRIGGER} AFTER UPDATE OF holder_run_id ON node_gpus
        FOR EACH ROW WHEN (OLD.holder_run_id IS NULL) <> (NEW.holder_run_id IS NULL)
        BEGIN
            UPDATE node_capacity
            SET available_gpus = available_gpus
                    + (CASE WHEN NEW.holder_run_id IS NULL THEN 1 ELSE -1 END),
                version = version + 1
            WHERE node_id = NEW.node_id;
            SELECT RAISE(ABORT, 'gpufleet: GPU row of a node without a capacity row')
            WHERE changes() = 0;
        END
        """
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    op.execute(f"DROP TRIGGER IF EXISTS {CAPACITY_TRIGGER}")
