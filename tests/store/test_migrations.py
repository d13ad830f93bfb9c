"""The one Alembic chain builds exactly the schema the ORM declares, on both databases."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from gpufleet.store.db import Database
from gpufleet.store.tables import Base


def test_migrations_match_the_declared_schema(db: Database) -> None:
    with db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": False})
        diffs = compare_metadata(ctx, Base.metadata)
    assert diffs == []
