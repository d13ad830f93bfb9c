"""Schema migrations: one Alembic chain for both databases, applied at process start."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from gpufleet.store import dialect
from gpufleet.store.db import Database

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def migrate(db: Database) -> None:
    """Upgrade the schema to head (idempotent; serialized across processes)."""
    cfg = alembic_config()
    with db.engine.connect() as conn, dialect.migration_lock(conn):
        if conn.in_transaction():
            conn.commit()
        with conn.begin():
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
