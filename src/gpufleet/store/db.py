"""Engines, sessions and transactions.

``Database.write_tx()`` is the one way to write: a short transaction that commits on success and
rolls back on any exception. Never call an agent, Redis or the object store inside it; do that
after commit and guard later writes by ``run_id + token`` (load -> process -> apply).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, Executable, Row, create_engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from gpufleet.store import dialect, outbox

T = TypeVar("T")


def _create_private_file(path: Path) -> None:
    """Create the SQLite file (and missing parents) readable by its owner only: 0600 in a new
    0700 directory. SQLite gives its -wal and -shm files the database file's mode. Jobs run as
    other users and must not read the database (tokens' hashes, every team's jobs)."""
    if path.exists() or str(path) == ":memory:":
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


class Database:
    """Owns the engine and session factories for one database URL.

    Args:
        url: SQLAlchemy URL, ``sqlite:///path`` or ``postgresql+psycopg://...``.
    """

    def __init__(self, url: str) -> None:
        if url.startswith("sqlite:///"):
            _create_private_file(Path(url.removeprefix("sqlite:///")))
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        self.url = url
        self.engine: Engine = create_engine(url, **dialect.engine_options(url))
        dialect.install_sqlite_hooks(self.engine)
        dialect.install_postgres_hooks(self.engine)
        self._read = sessionmaker(
            dialect.read_engine(self.engine), expire_on_commit=False, autoflush=False
        )
        self._snapshot = sessionmaker(
            dialect.snapshot_engine(self.engine), expire_on_commit=False, autoflush=False
        )
        self._writer_gate: contextlib.AbstractContextManager[object] = (
            threading.Lock() if self.is_sqlite else contextlib.nullcontext()
        )
        self._write = sessionmaker(
            dialect.write_engine(self.engine), expire_on_commit=False, autoflush=False
        )
        self._one_write = sessionmaker(
            dialect.one_write_engine(self.engine), expire_on_commit=False, autoflush=False
        )
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads. Closing it ends its transaction; loaded objects stay usable
        (detached, not expired). Its statements need not see one snapshot (PostgreSQL READ
        COMMITTED; SQLite without ``BEGIN``): use :meth:`snapshot` for that. Never write in
        it."""
        with self._read() as session:
            yield session

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Session]:
        """A read session whose statements all see one consistent snapshot (the invariant
        checker and the scheduler's snapshot need it; plain ``read`` may not)."""
        with self._snapshot() as session:
            yield session

    @contextlib.contextmanager
    def write_tx(self) -> Iterator[Session]:
        """A write transaction: commit on success, roll back on exception.

        On SQLite, writers of this process queue on a lock before ``BEGIN IMMEDIATE``: SQLite
        admits one writer at a time anyway, and its busy handler makes a waiting writer sleep
        in growing steps (up to 100 ms) instead of waking it when the lock frees."""
        with self._writer_gate, self._write() as session, session.begin():
            yield session

    @contextlib.contextmanager
    def one_write(self) -> Iterator[Session]:
        """A write of ONE statement, with reads before it that need not be atomic with it (as
        under PostgreSQL's READ COMMITTED): on SQLite without ``BEGIN IMMEDIATE``, a statement
        in autocommit being a transaction of its own; elsewhere as :meth:`write_tx`. Send at
        most one INSERT/UPDATE/DELETE in it and queue no rows (``store.outbox``): a second
        write would commit on its own, not with the first (checked at its end)."""
        with self._writer_gate, self._one_write() as session, session.begin():
            yield session
            if outbox.pending_tables(session):
                raise AssertionError("one_write: rows queued for a second statement")

    def run_write(self, fn: Callable[[Session], T], *, attempts: int = 5) -> T:
        """Run ``fn`` in a write transaction, retrying serialization failures and deadlocks
        (PostgreSQL 40001/40P01, SQLite 'database is locked') with a short backoff."""
        for i in range(attempts):
            try:
                with self.write_tx() as session:
                    return fn(session)
            except (OperationalError, DBAPIError) as exc:
                if i == attempts - 1 or not _is_retryable(exc):
                    raise
                time.sleep(0.01 * (2**i))
        raise AssertionError("unreachable")

    def run_statement(
        self, statement: Executable, params: dict[str, Any], *, attempts: int = 5
    ) -> Row[Any] | None:
        """Run ONE statement in autocommit (no BEGIN or COMMIT round trips: a statement is a
        transaction of its own, all or nothing) and return its first row; serialization
        failures and deadlocks are retried as in :meth:`run_write`. For PostgreSQL's
        several-step statements (``store.reserve_once``); never call it with a statement
        that must share a transaction with others."""
        for i in range(attempts):
            try:
                with self._autocommit.connect() as conn:
                    return conn.execute(statement, params).first()
            except (OperationalError, DBAPIError) as exc:
                if i == attempts - 1 or not _is_retryable(exc):
                    raise
                time.sleep(0.01 * (2**i))
        raise AssertionError("unreachable")

    def dispose(self) -> None:
        self.engine.dispose()


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database cannot be reached or used right now (connection
    refused or lost, pool exhausted, server shutting down, SQLite locked), as opposed to a
    bad statement or a constraint: callers answer "unavailable, retry later" for these."""
    if isinstance(exc, (OperationalError, InterfaceError, PoolTimeout)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def short_reason(exc: BaseException) -> str:
    """The first line of a database error, for an operator's log line (no traceback)."""
    orig = getattr(exc, "orig", None) or exc
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{type(orig).__name__}: {first[:300]}"


def _is_retryable(exc: DBAPIError) -> bool:
    code = getattr(exc.orig, "sqlstate", None)
    if code in ("40001", "40P01"):
        return True
    return "database is locked" in str(exc.orig)
