"""Rows queued on a write session and INSERTed at its commit, batched: all rows of one
table in one multi-row INSERT, and on PostgreSQL all tables in ONE statement
(``dialect.insert_together``). The audit events of every transition, the usage record of an
ended attempt and the run and reservation rows of a new attempt go this way, so a
transaction sends one INSERT for them instead of one per row or per table.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import FromClause, event
from sqlalchemy.orm import ORMExecuteState, Session

from gpufleet.store.dialect import insert_together

_QUEUED = "gpufleet.inserts"


def queue_insert(session: Session, table: FromClause, row: dict[str, Any]) -> None:
    """Queue one row of ``table`` on ``session``, written at commit with every other queued
    row: all of one table in one multi-row INSERT, and on PostgreSQL all tables in ONE
    statement (``dialect.insert_together``). Tables are written in the order they were
    first queued (queue parents first); rows of one table must name the same columns. Rows
    the ORM holds (``session.add``) are flushed before. A SELECT through the session in the
    same transaction writes the queued rows first, so that it sees them."""
    queued: dict[FromClause, list[dict[str, Any]]] = session.info.setdefault(_QUEUED, {})
    queued.setdefault(table, []).append(row)


def pending(session: Session, table: FromClause) -> list[dict[str, Any]]:
    """The rows of ``table`` queued on ``session`` and not yet written."""
    return list(session.info.get(_QUEUED, {}).get(table, ()))


def pending_tables(session: Session) -> list[FromClause]:
    """The tables with rows queued on ``session`` and not yet written."""
    return [t for t, rows in session.info.get(_QUEUED, {}).items() if rows]


def write_queued(session: Session) -> None:
    """Write the rows queued on ``session`` now (after the ORM's pending rows)."""
    queued = session.info.pop(_QUEUED, None)
    if queued:
        session.flush()
        insert_together(session, list(queued.items()))


@event.listens_for(Session, "before_commit")
def _write_at_commit(session: Session) -> None:
    """The queued rows of the committing transaction go before the commit itself."""
    write_queued(session)


@event.listens_for(Session, "do_orm_execute")
def _write_before_a_read(state: ORMExecuteState) -> None:
    """A SELECT in the same transaction sees the queued rows: they are written first (as
    the ORM's autoflush would). Only reads: UPDATEs between queueing and commit (a
    transaction that moves several rows) leave the batch whole."""
    if state.is_select and state.session.info.get(_QUEUED):
        write_queued(state.session)


@event.listens_for(Session, "after_rollback")
def _drop_queued(session: Session) -> None:
    """A rolled-back transaction's queued rows are dropped with it."""
    session.info.pop(_QUEUED, None)
