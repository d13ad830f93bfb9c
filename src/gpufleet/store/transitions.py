"""The only writer of ``status`` columns.

Each change: check the edge against the domain's transition table, run a guarded
``UPDATE ... WHERE id = :id AND status IN (:allowed_from) [AND guard columns]``, and append a
SchedulingEvent row in the same transaction. Events are queued on the session and written at
commit, all of one transaction in ONE multi-row INSERT (:func:`_write_events`): a
transaction that moves three rows sends one event statement, not three. With one allowed source
state the UPDATE is the only statement; with several, a ``SELECT ... FOR UPDATE`` first learns
which one the row is in (the event records it). 0 rows matched raises StaleState: the row moved
on (another status, token or epoch) and the caller's view was stale.

One other statement moves a status: PostgreSQL's one-statement reservation
(``store/reserve_once.py``) makes the job's PENDING -> SCHEDULED edge inside its single
statement, guarded the same way and checked against the same transition table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, cast

from sqlalchemy import ClauseElement, Table, bindparam, delete, null, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import StaleState
from gpufleet.domain.states import JOB_TERMINAL, RUN_TERMINAL, Machine, check_transition
from gpufleet.store import accounting
from gpufleet.store.dialect import now_sql
from gpufleet.store.outbox import queue_insert
from gpufleet.store.tables import (
    Base,
    JobRow,
    JobRunRow,
    NodeRow,
    NotifyOutboxRow,
    ReservationRow,
    SchedulingEventRow,
)

_TABLES: Mapping[Machine, type[Base]] = {
    Machine.JOB: JobRow,
    Machine.RUN: JobRunRow,
    Machine.RESERVATION: ReservationRow,
    Machine.NODE: NodeRow,
}


def transition(
    session: Session,
    machine: Machine,
    entity_id: str,
    to: str,
    *,
    now: datetime,
    frm: Iterable[str],
    guard: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
    message: str | None = None,
    details: Mapping[str, Any] | None = None,
    job_id: str | None = None,
    run_id: str | None = None,
    node_id: str | None = None,
    usage: accounting.AttemptFacts | None = None,
    ended_at: datetime | None = None,
    resources: Mapping[str, int | float] | None = None,
) -> str:
    """Move ``entity_id`` of ``machine`` to ``to`` from one of ``frm``; returns the old status.

    Args:
        frm: states the caller believes the row may be in; each ``frm -> to`` edge must be in
            the table (IllegalTransition otherwise), whatever the row's real state.
        guard: extra equality conditions (e.g. ``{"token": 7}``, ``{"fencing_epoch": 3}``).
        values: other columns to set in the same UPDATE.
        usage: a run reaching a terminal status: the attempt as the caller read it in this
            transaction, for its usage record (``accounting.record_attempt_end``).
        ended_at: a run reaching a terminal status: when its processes really ended (UTC,
            on the database's clock, at most ``now``), the end of its usage record; None =
            ``now`` (the attempt ends as the transition is made).
        resources: a run reaching a terminal status: what its agent measured of it, for its
            usage record (``accounting.record_attempt_end``); None = not measured.

    Raises:
        IllegalTransition: an edge ``frm -> to`` is not in the table.
        StaleState: no row matched (status, guard or id).
    """
    sources = sorted(set(frm))
    triggers = {s: check_transition(machine, s, to) for s in sources}
    guard = guard or {}
    values = values or {}
    # a job's end (or a finished job's revival): the UPDATE returns the job's webhooks, so
    # that a job with some gets its outbox row in this transaction and one without sends
    # no statement more
    notify = machine is Machine.JOB and (
        to in JOB_TERMINAL or any(s in JOB_TERMINAL for s in sources)
    )
    lock, change = _statements(machine, tuple(sources), guard, values, notify)
    params = {
        "p_id": entity_id,
        "p_to": to,
        **{f"g_{k}": v for k, v in guard.items()},
        **{f"v_{k}": v for k, v in values.items() if _bound(v)},
    }
    old: str | None = None
    result = None
    returned: list[Any] = []
    if lock is None:
        # one possible source: the guarded UPDATE alone locks, checks and moves the row (one
        # statement); its row count says whether the row was there in that state
        old = sources[0]
        result = session.execute(change, params)
    else:
        # several: lock the row and learn which state it is in (PostgreSQL FOR UPDATE; SQLite
        # holds the write lock since BEGIN IMMEDIATE), then update under the same conditions
        old = session.execute(lock, params).scalar_one_or_none()
        if old is not None:
            result = session.execute(change, params)
    if notify and result is not None:
        returned = list(result.all())  # with RETURNING the rows, not rowcount, say it moved
        matched = len(returned)
    else:
        matched = -1 if result is None else result.rowcount  # type: ignore[attr-defined]
    if old is None or result is None or matched != 1:
        raise StaleState(
            f"{machine.value} {entity_id}: not in {sources}"
            + (f" with {dict(guard)}" if guard else "")
            + f" (wanted -> {to})"
        )
    if machine is Machine.RUN and to in RUN_TERMINAL:
        # the one place every attempt ends: its usage record goes in the same transaction
        accounting.record_attempt_end(
            session,
            entity_id,
            outcome=str(to),
            end_at=now if ended_at is None else min(ended_at, now),
            facts=usage,
            resources=resources,
        )
    if notify and returned and returned[0].notify_urls:
        _queue_notify(session, entity_id, returned[0], str(old), to, now)
    record_transition(
        session,
        machine,
        entity_id,
        old,
        to,
        now=now,
        message=message,
        details=details,
        job_id=job_id,
        run_id=run_id,
        node_id=node_id,
        trigger=triggers[old],
    )
    return str(old)


_STATEMENTS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
""":func:`transition`'s statements by shape (machine, source states, guard and value column
names), built once with bind parameters (``p_id``, ``p_to``, ``g_<column>``, ``v_<column>``):
no statement construction or cache-key generation per transition (SQLAlchemy memoizes the
key of a statement object it has seen), and Core statements on the table, which skip the
ORM's bulk-UPDATE handling (with ``synchronize_session=False`` it did nothing else here)."""


def _bound(value: Any) -> bool:
    """Whether a value is passed as a bind parameter: not None (SQL NULL in the statement, as
    ``values(col=None)`` writes it; a JSON column would store a None parameter as JSON
    ``null``) and not a SQL expression."""
    return value is not None and not isinstance(value, ClauseElement)


def _queue_notify(
    session: Session, job_id: str, job: Any, old: str, to: str, now: datetime
) -> None:
    """The outbox row of a job with webhooks that has just ended (``to`` terminal), due at
    once; a finished job made PENDING again (``old`` terminal) drops the row of its earlier
    end, delivered or not, so that its next end gets a fresh one."""
    if old in JOB_TERMINAL:
        session.execute(delete(NotifyOutboxRow).where(NotifyOutboxRow.job_id == job_id))
    if to in JOB_TERMINAL:
        queue_insert(
            session,
            NotifyOutboxRow.__table__,
            {
                "job_id": job_id,
                "team_id": job.team_id,
                "urls": list(job.notify_urls),
                "status": to,
                "attempts": 0,
                "next_at": now,
                "created_at": now,
                "delivered_at": None,
                "gave_up": False,
                "last_error": None,
            },
        )


def _statements(
    machine: Machine,
    sources: tuple[str, ...],
    guard: Mapping[str, Any],
    values: Mapping[str, Any],
    notify: bool = False,
) -> tuple[Any, Any]:
    """(the locking read of the status, or None with one source state; the guarded UPDATE)
    of one shape; ``notify``: the UPDATE returns the job's ``notify_urls`` and ``team_id``.
    A guard on None or a value that is a SQL expression is built for this call
    only (not kept): ``= NULL`` would never match, and an expression is no parameter."""
    keep = all(v is not None for v in guard.values()) and not any(
        isinstance(v, ClauseElement) for v in values.values()
    )
    key = (
        machine,
        sources,
        tuple(guard),
        tuple((k, _bound(v)) for k, v in values.items()),
        notify,
    )
    hit = _STATEMENTS.get(key) if keep else None
    if hit is not None:
        return hit
    table = cast(Table, _TABLES[machine].__table__)
    cols = table.c
    conds = [cols.id == bindparam("p_id", type_=cols.id.type), cols.status.in_(sources)]
    conds += [
        cols[k] == bindparam(f"g_{k}", type_=cols[k].type) if keep else cols[k] == v
        for k, v in guard.items()
    ]
    sets: dict[str, Any] = {"status": bindparam("p_to", type_=cols.status.type)}
    sets.update(
        {
            k: bindparam(f"v_{k}", type_=cols[k].type)
            if _bound(v)
            else (null() if v is None else v)
            for k, v in values.items()
        }
    )
    change = update(table).where(*conds).values(sets)
    if notify:
        change = change.returning(cols.notify_urls, cols.team_id)
    lock = None if len(sources) == 1 else select(cols.status).where(*conds).with_for_update()
    if keep:
        if len(_STATEMENTS) >= 512:  # a bound: call sites have a few dozen shapes
            _STATEMENTS.clear()
        _STATEMENTS[key] = (lock, change)
    return lock, change


def record_transition(
    session: Session,
    machine: Machine,
    entity_id: str,
    frm: str,
    to: str,
    *,
    now: datetime,
    message: str | None = None,
    details: Mapping[str, Any] | None = None,
    job_id: str | None = None,
    run_id: str | None = None,
    node_id: str | None = None,
    trigger: str | None = None,
) -> None:
    """Append the event of a transition ``frm -> to`` that the caller has just made with a
    guarded statement of its own (:func:`transition` makes the usual ones). Checks the edge.

    Raises:
        IllegalTransition: ``frm -> to`` is not in the table.
    """
    if trigger is None:
        trigger = check_transition(machine, frm, to)
    _queue_event(
        session,
        {
            "at": now,
            "kind": "transition",
            "machine": machine.value,
            "entity_id": entity_id,
            "from_status": frm,
            "to_status": to,
            "trigger": trigger,
            "job_id": job_id,
            "run_id": run_id,
            "node_id": node_id,
            "message": message,
            "details": dict(details) if details else None,
        },
    )


def record_event(
    session: Session,
    kind: str,
    *,
    now: datetime | None = None,
    message: str,
    job_id: str | None = None,
    run_id: str | None = None,
    node_id: str | None = None,
    details: Mapping[str, Any] | None = None,
) -> None:
    """Append a non-transition audit event (a placement decision, a reconcile finding...)."""
    _queue_event(
        session,
        {
            # no clock given: the database's, read by the INSERT itself
            "at": now if now is not None else now_sql(session),
            "kind": kind,
            "job_id": job_id,
            "run_id": run_id,
            "node_id": node_id,
            "message": message,
            "details": dict(details) if details else None,
        },
    )


_EVENT_COLUMNS = tuple(c.name for c in SchedulingEventRow.__table__.c if c.name != "id")
"""Every row of one multi-row INSERT names the same columns (absent ones are NULL)."""


def _queue_event(session: Session, row: dict[str, Any]) -> None:
    """Queue one ``scheduling_events`` row on ``session``; written at commit."""
    queue_insert(session, SchedulingEventRow.__table__, {k: row.get(k) for k in _EVENT_COLUMNS})
