"""SQLite: a node's free-GPU count follows its GPU rows (a trigger), so that claiming or
freeing GPUs is ONE statement there, and new rows of several tables go in ONE INSERT (a view
and its INSTEAD OF trigger), as both are on PostgreSQL (docs/design/allocation.md,
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

``insert_rows`` (SQLite only): a view that holds nothing, with a column ``<table>__<column>``
for every column the code writes of ``job_runs``, ``reservations``, ``scheduling_events`` and
``usage_records`` (not ``change_seq``, set by 0006s's triggers, nor the events' generated
``id``), and ``tbl`` naming the row's table. Its INSTEAD OF INSERT trigger ``insert_rows_ins``
inserts each row into the table ``tbl`` names (any other ``tbl`` aborts), with that table's own
constraints, affinities and triggers, so a multi-row ``INSERT INTO insert_rows`` writes the
rows of several tables, in the order given (parents first), all or none: the one statement
PostgreSQL writes with data-modifying WITH (``dialect.insert_together``). Every column of a
table is written, so the code sends a row this way only when it names every column with a
default (``rank``, ``gang_size``, ``user``); a column the view lacks fails the statement
(nothing is written to a wrong column). A later migration adding a column to one of these
tables must create the view and trigger again (``tests/store/test_sql_budget.py`` checks that
the view covers every column).

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


INSERT_ROWS = "insert_rows"
INSERT_COLUMNS: dict[str, tuple[str, ...]] = {
    "job_runs": (
        "id",
        "job_id",
        "attempt",
        "node_id",
        "status",
        "token",
        "gpu_ids",
        "exit_code",
        "pid",
        "manifest_uri",
        "checkpoint_prefix",
        "message",
        "stop_reason",
        "stop_requested_at",
        "preempted_for_job_id",
        "preempt_reason",
        "assigned_at",
        "charged_to",
        "rank",
        "gang_size",
        "master_port",
        "gang_outcome",
        "start_phases",
        "created_at",
        "started_at",
        "finished_at",
    ),
    "reservations": (
        "id",
        "run_id",
        "job_id",
        "node_id",
        "gpu_ids",
        "gpu_count",
        "status",
        "token",
        "leader_epoch",
        "lease_expires_at",
        "created_at",
        "released_at",
    ),
    "scheduling_events": (
        "at",
        "kind",
        "machine",
        "entity_id",
        "from_status",
        "to_status",
        "trigger",
        "job_id",
        "run_id",
        "node_id",
        "message",
        "details",
    ),
    "usage_records": (
        "run_id",
        "job_id",
        "attempt",
        "team_id",
        "token_id",
        "user",
        "node_id",
        "gpu_type",
        "gpus",
        "start_at",
        "end_at",
        "gpu_seconds",
        "outcome",
    ),
}
"""The columns of the view, per table, as of this revision."""


def _q(name: str) -> str:
    return f'"{name}"'


def create_insert_rows(columns: dict[str, tuple[str, ...]]) -> None:
    """Create the view :data:`INSERT_ROWS` and its trigger for ``columns`` (per table, as
    :data:`INSERT_COLUMNS`; a later migration adding a column passes its own list)."""
    view_columns = ["tbl"] + [f"{t}__{c}" for t, cols in columns.items() for c in cols]
    op.execute(
        f"CREATE VIEW {INSERT_ROWS} ({', '.join(_q(c) for c in view_columns)}) AS SELECT "
        + ", ".join("NULL" for _ in view_columns)
        + " WHERE 0"
    )
    inserts = "".join(
        f"INSERT INTO {t} ({', '.join(_q(c) for c in cols)}) "
        f"SELECT {', '.join('NEW.' + _q(f'{t}__{c}') for c in cols)} WHERE NEW.tbl = '{t}'; "
        for t, cols in columns.items()
    )
    known = ", ".join(f"'{t}'" for t in columns)
    op.execute(
        f"CREATE TRIGGER {INSERT_ROWS}_ins INSTEAD OF INSERT ON {INSERT_ROWS} FOR EACH ROW "
        f"BEGIN SELECT RAISE(ABORT, 'gpufleet: insert_rows: no such table') "
        f"WHERE NEW.tbl IS NULL OR NEW.tbl NOT IN ({known}); {inserts}END"
    )


def drop_insert_rows() -> None:
    """Drop the view :data:`INSERT_ROWS` and its trigger."""
    op.execute(f"DROP TRIGGER IF EXISTS {INSERT_ROWS}_ins")
    op.execute(f"DROP VIEW IF EXISTS {INSERT_ROWS}")


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    create_insert_rows(INSERT_COLUMNS)
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
    drop_insert_rows()
    op.execute(f"DROP TRIGGER IF EXISTS {CAPACITY_TRIGGER}")
