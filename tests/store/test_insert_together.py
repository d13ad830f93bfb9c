"""``dialect.insert_together`` on SQLite: several tables' rows in ONE statement through the
``insert_rows`` view (migration 0007a), stored exactly as one INSERT per table stores them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.exc import IntegrityError

from gpufleet.store import dialect
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate
from gpufleet.store.tables import SchedulingEventRow, UsageRecordRow

VIEW_TABLES = ("job_runs", "reservations", "scheduling_events", "usage_records")


def sqlite_db(path: Path) -> Database:
    db = Database(f"sqlite:///{path}")
    migrate(db)
    return db


def test_the_view_has_every_column_the_code_writes(tmp_path: Path) -> None:
    """A column added to one of the tables needs a migration that creates the view again."""
    from gpufleet.store.tables import Base

    db = sqlite_db(tmp_path / "a.db")
    with db.read() as s:
        have = {r[1] for r in s.execute(text(f"PRAGMA table_info({dialect.SQLITE_INSERT_ROWS})"))}
    want = {"tbl"} | {
        f"{t}__{c.name}"
        for t in VIEW_TABLES
        for c in Base.metadata.tables[t].c
        if c.name != "change_seq" and not (t == "scheduling_events" and c.name == "id")
    }
    assert have == want
    assert set(VIEW_TABLES) == dialect.SQLITE_INSERT_TABLES


AT = datetime(2026, 12, 1, 9, 30, 1, 123456, tzinfo=UTC)


def rows() -> list[tuple[Any, list[dict[str, Any]]]]:
    event_row = {
        "at": AT,
        "kind": "transition",
        "machine": "JOB",
        "entity_id": "j-1",
        "from_status": "PENDING",
        "to_status": "SCHEDULED",
        "trigger": "reserve",
        "job_id": "j-1",
        "run_id": None,
        "node_id": "n1",
        "message": "it's 'quoted'",
        "details": {"a": [1, 2.5], "b": None, "c": "x"},
    }
    usage = {
        "run_id": "r-1",
        "job_id": "j-1",
        "attempt": 1,
        "team_id": "team-a",
        "token_id": None,
        "user": "",
        "node_id": "n1",
        "gpu_type": "A100",
        "gpus": 2,
        "start_at": AT,
        "end_at": AT,
        "gpu_seconds": 0.1 + 0.2,  # 0.30000000000000004: kept to the last bit
        "outcome": "SUCCEEDED",
    }
    return [
        (SchedulingEventRow.__table__, [event_row, {**event_row, "details": None}]),
        (UsageRecordRow.__table__, [usage]),
    ]


def stored(db: Database) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    with db.read() as s:
        for t in ("scheduling_events", "usage_records"):
            cols = _cols(t)
            exprs = ", ".join(f'typeof("{c}"), quote("{c}")' for c in cols)
            out += [tuple(r) for r in s.execute(text(f"SELECT {exprs} FROM {t} ORDER BY rowid"))]
    return out


def _cols(table: str) -> list[str]:
    from gpufleet.store.tables import Base

    return [c.name for c in Base.metadata.tables[table].c if c.name not in ("id", "change_seq")]


def test_rows_through_the_view_are_stored_as_by_one_insert_per_table(tmp_path: Path) -> None:
    together, apart = sqlite_db(tmp_path / "a.db"), sqlite_db(tmp_path / "b.db")
    sent: list[str] = []
    event.listen(together.engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    with together.write_tx() as s:
        dialect.insert_together(s, rows())
    with apart.write_tx() as s:
        for group in rows():
            dialect.insert_together(s, [group])
    assert [q.split(" (")[0] for q in sent if q.startswith("INSERT")] == [
        "INSERT INTO insert_rows"
    ]
    assert stored(together) == stored(apart)
    assert len(stored(together)) == 3
    with together.read() as s:
        assert s.scalar(select(UsageRecordRow.gpu_seconds)) == 0.1 + 0.2


def test_a_failing_row_writes_none_of_the_statement(tmp_path: Path) -> None:
    db = sqlite_db(tmp_path / "a.db")
    with db.write_tx() as s:
        dialect.insert_together(s, rows())
    # the usage record exists: its row fails, and the events before it in the same statement
    # are not written either (no BEGIN here: the statement is its own transaction)
    with pytest.raises(IntegrityError), db.one_write() as s:
        dialect.insert_together(s, rows())
    assert len(stored(db)) == 3
