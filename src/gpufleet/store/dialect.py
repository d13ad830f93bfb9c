"""The only place where SQLite and PostgreSQL differ: engine options, BEGIN mode, the database
clock, inserts that may race (``ON CONFLICT``), and the migration lock."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    ClauseElement,
    ColumnElement,
    Connection,
    Engine,
    FromClause,
    TableClause,
    bindparam,
    event,
    func,
    insert,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine.interfaces import BindTyping
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session

SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 5


def engine_options(url: str) -> dict[str, Any]:
    """Keyword arguments for ``create_engine`` for this database."""
    if url.startswith("sqlite"):
        return {
            "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
        }
    # a database host that drops packets must not hold a request for minutes: connecting
    # fails after PG_CONNECT_TIMEOUT_S and the API answers 503 (the kernel's default is ~2 min)
    # no pool_pre_ping: it costs a round trip per transaction (install_postgres_hooks pings
    # only a connection that sat idle in the pool)
    return {
        "pool_size": 10,
        "max_overflow": 20,
        "pool_timeout": 10,
        "connect_args": {"connect_timeout": PG_CONNECT_TIMEOUT_S},
    }


PING_AFTER_IDLE_S = 2.0
"""A pooled PostgreSQL connection that sat idle this long is pinged when checked out."""


def install_postgres_hooks(engine: Engine) -> None:
    """Ping a pooled connection at checkout only when it was idle for ``PING_AFTER_IDLE_S``
    (SQLAlchemy's "pessimistic" disconnect handling with a custom checkout event, as in its
    pooling docs, instead of ``pool_pre_ping``, which pings on every checkout: one more
    round trip per transaction, ~1 in 7 of a reservation's). A dead connection is replaced
    before use, as with ``pool_pre_ping``; one that died within the last seconds of use fails
    its statement, which invalidates the pool (SQLAlchemy does that on a disconnect error),
    and the caller retries as for any lost connection (the API answers 503)."""
    if engine.dialect.name != "postgresql":
        return
    dialect = engine.dialect

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.pop("idle_since", None)
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_S:
            return
        try:
            dialect.do_ping(dbapi_conn)
        except dialect.loaded_dbapi.Error as err:
            if dialect.is_disconnect(err, dbapi_conn, None):
                # the pool discards this connection and checks out another (up to 3 tries)
                raise DisconnectionError(str(err)) from err
            raise


def install_sqlite_hooks(engine: Engine) -> None:
    """WAL, foreign keys, busy timeout; and explicit BEGIN so that write transactions take
    the write lock at their start (``BEGIN IMMEDIATE``) instead of failing on upgrade."""
    if engine.dialect.name != "sqlite":
        return

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # let SQLAlchemy's BEGIN below control transactions
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        if mode:  # read_engine: none, each statement is its own (autocommit) transaction
            conn.exec_driver_sql(f"BEGIN {mode}")


def one_write_engine(engine: Engine) -> Engine:
    """The same pool, for a write that is ONE statement (reads before it need not be atomic
    with it): on SQLite no ``BEGIN`` (the statement is its own transaction in autocommit, all
    or nothing, and takes the write lock only while it runs); PostgreSQL as
    :func:`write_engine` (its driver begins a transaction without a statement of ours)."""
    if engine.dialect.name == "sqlite":
        return engine.execution_options(sqlite_begin="")
    return write_engine(engine)


def write_engine(engine: Engine) -> Engine:
    """The same pool, but transactions begin as writers (SQLite ``BEGIN IMMEDIATE``;
    PostgreSQL READ COMMITTED, row locks taken by the conditional UPDATEs themselves)."""
    return engine.execution_options(sqlite_begin="IMMEDIATE")


_CTE_INSERTS: dict[tuple[Any, ...], Any] = {}
"""PostgreSQL statements of :func:`insert_together`, by shape (tables, rows per table, column
names): built once, with bind parameters instead of values, so SQLAlchemy compiles each shape
once (its cache skips multi-row VALUES, and building a statement from values coerces every
value: together ~20% of a reservation's client CPU on PostgreSQL, and ~10% of the
controller's CPU per tiny job in the completion's events + usage record, benchmarks/README.md).
"""

_NAMED_PG = postgresql.dialect(paramstyle="named")  # type: ignore[no-untyped-call]
_NAMED_PG.bind_typing = BindTyping.NONE
"""PostgreSQL's dialect rendering plain ``:name`` parameters (no ``::TYPE`` casts, which
``text()`` would misread), to turn a statement into ``text()``; the server takes each
parameter's type from its INSERT column."""

_CTE_SHAPES_MAX = 256
"""A bound on the kept shapes (a transaction writes a handful of shapes; not expected to be
reached)."""


def _cte_insert(
    tables: list[tuple[TableClause, list[dict[str, Any]]]],
) -> tuple[Any, dict[str, Any]] | None:
    """PostgreSQL's ONE statement for several tables, built once per shape, and its
    parameters, when every row of a table names the same columns with plain values (no SQL
    expression) and the rows name every column that has a Python-side default; else None."""
    params: dict[str, Any] = {}
    shape: list[tuple[TableClause, int, tuple[str, ...]]] = []
    for i, (t, rows) in enumerate(tables):
        cols = tuple(rows[0])
        if any(c.default is not None and c.name not in rows[0] for c in t.c):
            return None  # a Python-side default the compiled text would not apply
        for r, row in enumerate(rows):
            if tuple(row) != cols:
                return None
            for k, v in row.items():
                if isinstance(v, ClauseElement):
                    return None
                params[f"g{i}_{r}_{k}"] = v
        shape.append((t, len(rows), cols))
    key = tuple(shape)
    stmt = _CTE_INSERTS.get(key)
    if stmt is None:
        *first, last = [
            insert(t).values(
                [
                    {k: bindparam(f"g{i}_{r}_{k}", type_=t.c[k].type) for k in cols}
                    for r in range(n)
                ]
            )
            for i, (t, n, cols) in enumerate(shape)
        ]
        core = last.add_cte(*(ins.cte(f"ins{i}") for i, ins in enumerate(first)))
        # SQLAlchemy gives a multi-row VALUES statement no cache key (it would compile it on
        # every execution, bind parameters or not): compile it once here into SQL text, whose
        # cache key is its string, with the columns' types on its parameters
        sql = str(core.compile(dialect=_NAMED_PG))
        stmt = text(sql).bindparams(
            *(
                bindparam(f"g{i}_{r}_{k}", type_=t.c[k].type)
                for i, (t, n, cols) in enumerate(shape)
                for r in range(n)
                for k in cols
            )
        )
        if len(_CTE_INSERTS) >= _CTE_SHAPES_MAX:
            _CTE_INSERTS.clear()
        _CTE_INSERTS[key] = stmt
    return stmt, params


SQLITE_INSERT_ROWS = "insert_rows"
"""SQLite's view whose INSTEAD OF INSERT trigger writes each row into the table its ``tbl``
column names (migration 0007a): several tables' rows in ONE statement, the SQLite form of
PostgreSQL's data-modifying WITH. Its columns are ``<table>__<column>``."""

SQLITE_INSERT_TABLES = frozenset(
    {"job_runs", "reservations", "scheduling_events", "usage_records"}
)
"""The tables :data:`SQLITE_INSERT_ROWS` writes."""

SQLITE_MAX_VARIABLES = 32_766
"""SQLite's limit on bound parameters per statement (3.32+): a larger batch is split."""

_VIEW_INSERTS: dict[tuple[Any, ...], Any] = {}
"""SQLite statements of :func:`insert_together` through the view, by shape (as
:data:`_CTE_INSERTS`)."""


@functools.cache
def _defaulted(table: TableClause) -> frozenset[str]:
    """The columns of ``table`` with a default that a row written through the view must name
    (``change_seq`` is not the view's)."""
    return frozenset(
        c.name
        for c in table.c
        if (c.default is not None or c.server_default is not None) and c.name != "change_seq"
    )


def _view_insert(
    tables: list[tuple[TableClause, list[dict[str, Any]]]],
) -> list[tuple[Any, dict[str, Any]]] | None:
    """SQLite's statements for several tables through :data:`SQLITE_INSERT_ROWS` (one, unless
    the rows bind more than :data:`SQLITE_MAX_VARIABLES` values), each built once per shape,
    and their parameters; None when a table is not one the view writes, a row holds an SQL
    expression, or a row leaves out a column that has a default (the view's trigger writes
    every column of its table: an absent one would be NULL, not its default)."""
    rows: list[tuple[TableClause, dict[str, Any]]] = []
    for t, group in tables:
        if t.name not in SQLITE_INSERT_TABLES:
            return None
        defaulted = _defaulted(t)
        for row in group:
            if not defaulted.issubset(row):
                return None
            for v in row.values():
                if isinstance(v, ClauseElement):
                    return None
            rows.append((t, row))
    columns: list[tuple[TableClause, str]] = list(
        dict.fromkeys((t, k) for t, row in rows for k in row)
    )
    per_statement = max(1, SQLITE_MAX_VARIABLES // (len(columns) + 1))
    out = []
    for start in range(0, len(rows), per_statement):
        chunk = rows[start : start + per_statement]
        key = (tuple((t, tuple(row)) for t, row in chunk), tuple(columns))
        stmt = _VIEW_INSERTS.get(key)
        if stmt is None:
            names = ", ".join(['"tbl"'] + [f'"{t.name}__{c}"' for t, c in columns])
            values = ", ".join(
                "("
                + ", ".join(
                    [f":r{i}_tbl"]
                    + [f":r{i}_{c}" if t is rt and c in row else "NULL" for t, c in columns]
                )
                + ")"
                for i, (rt, row) in enumerate(chunk)
            )
            stmt = text(f"INSERT INTO {SQLITE_INSERT_ROWS} ({names}) VALUES {values}").bindparams(
                *(
                    bindparam(f"r{i}_{c}", type_=t.c[c].type)
                    for i, (t, row) in enumerate(chunk)
                    for c in row
                )
            )
            if len(_VIEW_INSERTS) >= _CTE_SHAPES_MAX:
                _VIEW_INSERTS.clear()
            _VIEW_INSERTS[key] = stmt
        params: dict[str, Any] = {}
        for i, (t, row) in enumerate(chunk):
            params[f"r{i}_tbl"] = t.name
            params.update({f"r{i}_{c}": v for c, v in row.items()})
        out.append((stmt, params))
    return out


def insert_together(
    session: Session, groups: Sequence[tuple[FromClause, list[dict[str, Any]]]]
) -> None:
    """INSERT every group's rows (no RETURNING), in the order given (parents before
    children), with statements SQLAlchemy compiles once per shape (its cache skips
    multi-row VALUES statements, which it would compile on every call):

    - PostgreSQL with several tables: ONE statement, the earlier tables as data-modifying
      CTEs of the last one's INSERT (foreign keys are checked at the end of the statement);
      built once per shape (tables, rows per table, columns) with bind parameters when the
      rows hold plain values (a reservation's run, reservation and event; a completion's
      events and usage record), else with multi-row VALUES lists (compiled each time);
    - SQLite with several tables: ONE statement (per 32,766 bound values), an INSERT of
      every row into the view :data:`SQLITE_INSERT_ROWS`, whose INSTEAD OF trigger writes
      each into its table, in order (migration 0007a), when the rows hold plain values and
      name every column with a default;
    - else (one table, or rows that cannot go the ways above): one executemany per table,
      columns holding the database clock (:func:`now_sql`) inside the statement."""
    tables = [(cast(TableClause, t), rows) for t, rows in groups if rows]
    if not tables:
        return
    if session.get_bind().dialect.name == "postgresql" and len(tables) > 1:
        cached = _cte_insert(tables)
        if cached is not None:
            session.execute(*cached)
            return
        *first, (last, last_rows) = tables
        ctes = [insert(t).values(rows).cte(f"ins{i}") for i, (t, rows) in enumerate(first)]
        session.execute(insert(last).values(last_rows).add_cte(*ctes))
        return
    if len(tables) > 1:
        through_view = _view_insert(tables)
        if through_view is not None:
            for stmt, params in through_view:
                session.execute(stmt, params)
            return
    for t, rows in tables:
        _insert_many(session, t, rows)


def _insert_many(session: Session, table: TableClause, rows: list[dict[str, Any]]) -> None:
    """One executemany: columns holding the same SQL expression in every row (the database
    clock of :func:`now_sql`) go into the statement, the rest are bound per row. Rows whose
    expressions differ fall back to one multi-row VALUES statement."""
    first = rows[0]
    exprs = {k: v for k, v in first.items() if isinstance(v, ClauseElement)}
    if not exprs:
        session.execute(insert(table), rows)
        return
    for row in rows[1:]:
        for k, v in exprs.items():
            other = row.get(k)
            if other is v:  # now_sql's one expression object (the usual case): no compare
                continue
            if not isinstance(other, ClauseElement) or not v.compare(other):
                session.execute(insert(table).values(rows))
                return
    params = [{k: v for k, v in row.items() if k not in exprs} for row in rows]
    session.execute(insert(table).values(exprs), params)


def insert_if_absent(session: Session, table: FromClause, row: dict[str, Any]) -> bool:
    """INSERT ``row`` unless a row with the same primary key (or another unique key) exists:
    ``INSERT ... ON CONFLICT DO NOTHING`` on both databases. Returns True when this call
    inserted it.

    This is the shape for every create that two callers may race on (two admins creating
    one team, two controllers recording the fleet CA, a node registering twice at once): a
    read-then-insert lets both read "absent" and one INSERT then fails with a unique
    violation (HTTP 500). Here the loser's INSERT waits for the winner's transaction on
    PostgreSQL (READ COMMITTED) and then does nothing; the caller answers 409 (or treats the
    row as already there). On SQLite writers are serialized by ``BEGIN IMMEDIATE`` anyway;
    the statement is the same. Python-side column defaults apply (Core insert)."""
    t = cast(TableClause, table)
    name = session.get_bind().dialect.name
    stmt: Any
    if name == "postgresql":
        stmt = postgresql.insert(t).values(row).on_conflict_do_nothing()
    else:
        stmt = sqlite.insert(t).values(row).on_conflict_do_nothing()
    # SQLAlchemy keeps an INSERT's rowcount only when asked to (0: the row was there)
    result = session.execute(stmt.execution_options(preserve_rowcount=True))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def capacity_follows_gpu_rows(dialect: str) -> bool:
    """Whether a node's ``node_capacity.available_gpus`` (and ``version``) moves by itself
    when its GPU rows are claimed or freed: SQLite, by the trigger of migration 0007a, so that
    a claim or a release is one UPDATE of ``node_gpus``; PostgreSQL updates the capacity row
    explicitly, in the same statement (data-modifying WITH)."""
    return dialect == "sqlite"


def dml_in_cte(dialect: str) -> bool:
    """Whether INSERT, UPDATE and DELETE may run as WITH queries of one statement
    (PostgreSQL; SQLite has no data-modifying WITH)."""
    return dialect == "postgresql"


def statements_with(dialect: str, main: Any, *before: Any) -> list[Any]:
    """The DML statements ``before`` and then ``main`` for a dialect name, to build once and
    keep: PostgreSQL ONE statement, ``before`` as data-modifying CTEs of ``main`` (all on one
    snapshot: use only for statements on rows that no other statement of the group reads);
    SQLite one statement each, in order. Run them with :func:`execute_all`."""
    if dialect == "postgresql" and before:
        return [main.add_cte(*(stmt.cte(f"w{i}") for i, stmt in enumerate(before)))]
    return [*before, main]


def execute_all(session: Session, statements: Sequence[Any], params: dict[str, Any]) -> Any:
    """Execute ``statements`` in order with the same ``params``; returns the last one's
    result (:func:`statements_with`: ``main``'s row count, its RETURNING rows)."""
    result = None
    for stmt in statements:
        result = session.execute(stmt, params)
    return result


def read_engine(engine: Engine) -> Engine:
    """The same pool, for plain reads that need no single snapshot: on SQLite no ``BEGIN``
    (a statement of its own per session): each statement reads in its own implicit
    transaction, as each does under PostgreSQL's READ COMMITTED."""
    if engine.dialect.name == "sqlite":
        return engine.execution_options(sqlite_begin="")
    return engine


def snapshot_engine(engine: Engine) -> Engine:
    """Transactions whose reads all see one snapshot: PostgreSQL REPEATABLE READ (READ
    COMMITTED would give each SELECT its own); SQLite in WAL already reads one snapshot per
    transaction."""
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="REPEATABLE READ")
    return engine


def now_sql(session: Session, *, stable: bool = False) -> ColumnElement[Any]:
    """The database clock of :func:`db_now` as a SQL expression, to fold into another
    statement (a guard ``expires_at > now``, a ``RETURNING`` that tells the caller the time)
    instead of a statement of its own. Read a returned value with :func:`as_utc`.

    ``stable``: every use in one statement gives the same value (PostgreSQL
    ``statement_timestamp()``, the statement's start; SQLite's ``'now'`` is stable anyway),
    for two columns that must be equal."""
    return now_sql_for(session.get_bind().dialect.name, stable=stable)


@functools.cache
def now_sql_for(dialect: str, *, stable: bool = False) -> ColumnElement[Any]:
    """:func:`now_sql` for a dialect name (``sqlite``, ``postgresql``), for statements built
    once and kept. One expression object per (dialect, stable), built once: rows queued with
    it are recognised as holding the same clock by identity (``_insert_many``), not by a
    structural compare per row (~85 us each: 0.5 s for a pass's 6,000 event rows)."""
    if dialect == "sqlite":
        # SQLite keeps datetimes as text, compared as text: store the clock in SQLAlchemy's
        # own format (6 fractional digits; %f gives 3), or a value written by this expression
        # sorts before the same instant bound from Python ('...01.123' < '...01.123000')
        return func.strftime("%Y-%m-%d %H:%M:%f", "now").concat("000")
    return func.statement_timestamp() if stable else func.clock_timestamp()


def as_utc(value: Any) -> datetime:
    """A clock value returned by a :func:`now_sql` expression, as an aware UTC datetime."""
    if isinstance(value, str):
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    assert isinstance(value, datetime)
    return value.astimezone(UTC)


def db_now(session: Session) -> datetime:
    """The database's clock, UTC-aware. Leases and timeouts compare against this only."""
    if session.get_bind().dialect.name == "sqlite":
        raw = session.execute(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar_one()
        return datetime.fromisoformat(raw).replace(tzinfo=UTC)
    value: datetime = session.execute(text("SELECT clock_timestamp()")).scalar_one()
    return value.astimezone(UTC)


def change_floor_sql(session: Session) -> tuple[str, str]:
    """SQL for the smallest ``change_seq`` (migration 0006s) that a row written after this
    snapshot can carry: read it in a snapshot, and a later snapshot finds every row inserted
    or changed since with ``change_seq >= floor`` (and possibly a few more); and SQL naming
    the database server's incarnation, which changes when it restarts or a replica takes
    over (a reader then trusts no floor it kept).

    PostgreSQL: the snapshot's ``xmin`` (every transaction id below it had ended when the
    snapshot was taken), and the server's start time. SQLite: one more than the last value of
    the triggers' counter (writers are serialized), and a constant (the file is the server)."""
    if session.get_bind().dialect.name == "sqlite":
        return "(SELECT coalesce(max(seq), 0) + 1 FROM change_seq_counter)", "'sqlite'"
    return (
        "pg_snapshot_xmin(pg_current_snapshot())::text::bigint",
        "pg_postmaster_start_time()::text",
    )


def change_floor(session: Session) -> tuple[int, str]:
    """:func:`change_floor_sql`'s values (call inside ``Database.snapshot()``)."""
    floor_sql, server_sql = change_floor_sql(session)
    row = session.execute(text(f"SELECT {floor_sql}, CAST({server_sql} AS VARCHAR(64))")).one()
    return int(row[0]), str(row[1])


def change_triggers_present(session: Session, tables: tuple[str, ...]) -> bool:
    """Whether the insert and update triggers that set ``change_seq`` exist on every table
    (a table that SQLite rebuilt in a migration loses its triggers)."""
    names = [f"{t}_change_seq_{op}" for t in tables for op in ("ins", "upd")]
    if session.get_bind().dialect.name == "sqlite":
        query = "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND name IN :names"
    else:
        query = "SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal AND tgname IN :names"
    stmt = text(query).bindparams(bindparam("names", expanding=True))
    return int(session.execute(stmt, {"names": names}).scalar_one()) == len(names)


@contextlib.contextmanager
def migration_lock(conn: Connection) -> Iterator[None]:
    """Serialize concurrent migrations (PostgreSQL advisory lock; SQLite's write lock suffices)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_lock(7244501)"))
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(7244501)"))
    else:
        yield
