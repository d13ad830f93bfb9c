"""Schema revision checks (``store.migrate``) on real SQLite and PostgreSQL databases."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from gpufleet.store.db import Database
from gpufleet.store.migrate import (
    SchemaMismatch,
    check_schema,
    head_revision,
    migrate,
    schema_state,
)
from tests.conftest import PG_ADMIN_URL, _admin

PREVIOUS = "0008c"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """An empty database (nothing migrated)."""
    if request.param == "sqlite":
        db = Database(f"sqlite:///{tmp_path / 'gpufleet.db'}")
        yield db
        db.dispose()
        return
    name = f"gpufleet_schema_{uuid.uuid4().hex[:12]}"
    _admin(f'CREATE DATABASE "{name}"')
    db = Database(PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name)
    try:
        yield db
    finally:
        db.dispose()
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_empty_older_current_and_newer_schemas(empty: Database) -> None:
    head = head_revision()
    state = schema_state(empty)
    assert state.current is None and state.pending[-1] == head and state.known
    with pytest.raises(SchemaMismatch, match=r"no gpufleet schema.*gpufleet admin migrate"):
        check_schema(empty)

    assert migrate(empty, PREVIOUS) == (None, PREVIOUS)
    state = schema_state(empty)
    assert state.pending[-1] == head and PREVIOUS not in state.pending
    assert not state.up_to_date
    with pytest.raises(SchemaMismatch, match=f"at revision {PREVIOUS}, older"):
        check_schema(empty)
    with pytest.raises(SchemaMismatch, match="older"):
        check_schema(empty, allow_newer=True)  # older is never allowed

    assert migrate(empty) == (PREVIOUS, head)
    assert check_schema(empty).up_to_date
    assert migrate(empty) == (head, head)  # idempotent

    with empty.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099z'"))
    assert not schema_state(empty).known
    with pytest.raises(SchemaMismatch, match=r"0099z, which this gpufleet .* does not know"):
        check_schema(empty)
    assert check_schema(empty, allow_newer=True).current == "0099z"
    with pytest.raises(SchemaMismatch, match="0099z"):
        migrate(empty)


def test_downgrade_and_unknown_target(empty: Database) -> None:
    migrate(empty)
    assert migrate(empty, PREVIOUS) == (head_revision(), PREVIOUS)
    with pytest.raises(SchemaMismatch, match="unknown revision 'nope'"):
        migrate(empty, "nope")
    assert schema_state(empty).current == PREVIOUS
