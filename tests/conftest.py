"""Shared fixtures. PostgreSQL and Redis are real servers; when configured but down, the tests
that need them ERROR (they are never skipped).

- ``GPUFLEET_TEST_POSTGRES_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``):
  each xdist worker gets its own database ``gpufleet_test_<worker>``, migrated once and emptied
  between tests.
- ``GPUFLEET_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/15``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from gpufleet.services.job_admission import forget_fleet_shapes, forget_outstanding_counts
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate
from gpufleet.store.tables import Base

PG_ADMIN_URL = os.environ.get(
    "GPUFLEET_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("GPUFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _admin(sql: str, *args: object) -> None:
    conninfo = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql, args or None)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def pg_url(worker_id: str, testrun_uid: str) -> Iterator[str]:
    """URL of a migrated PostgreSQL database of this test run and xdist worker (created here,
    dropped at the end, so concurrent runs never share one). Errors if PostgreSQL is down."""
    name = f"gpufleet_test_{testrun_uid[:10]}_{worker_id}".lower()
    _admin(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    db = Database(url)
    migrate(db)
    db.dispose()
    yield url
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _empty(db: Database) -> None:
    names = [t.name for t in reversed(Base.metadata.sorted_tables)]
    with db.engine.begin() as conn:
        if db.is_sqlite:
            for n in names:
                conn.execute(text(f"DELETE FROM {n}"))
        else:
            conn.execute(text(f"TRUNCATE {', '.join(names)} RESTART IDENTITY CASCADE"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A migrated, empty database: SQLite file and real PostgreSQL (parametrized)."""
    forget_fleet_shapes()
    forget_outstanding_counts()
    if request.param == "sqlite":
        database = Database(f"sqlite:///{tmp_path / 'gpufleet.db'}")
        migrate(database)
    else:
        database = Database(request.getfixturevalue("pg_url"))
        _empty(database)
    yield database
    database.dispose()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Test hygiene: remove the job namespaces, veths and nftables tables of agents that are
    gone (agent subprocesses killed with SIGKILL) and of this process's in-process agents
    (all stopped by now), with the agent's own sweep; a job still in its namespace keeps it.
    Only where an agent recorded one (root, with ``ip`` and ``nft``)."""
    from gpufleet.agent.runtime import jobnet_owners

    if os.geteuid() != 0 or not jobnet_owners.REGISTRY_DIR.is_dir():
        return
    try:
        swept = jobnet_owners.sweep(ended_owners={os.getpid()})
    except OSError as exc:
        swept_line = f"job network sweep failed: {exc}"
    else:
        if not swept:
            return
        swept_line = f"job network: {swept.describe()}"
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(swept_line)
