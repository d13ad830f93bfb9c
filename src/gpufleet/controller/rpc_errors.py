"""One mapping of errors to gRPC statuses for every controller service (no traceback, host
name or driver message crosses the wire)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from sqlalchemy.exc import SQLAlchemyError

from gpufleet.domain.errors import GpufleetError
from gpufleet.rpc import tls
from gpufleet.store.db import is_unavailable
from gpufleet.store.outage import DatabaseOutage

log = logging.getLogger("gpufleet.controller")
T = TypeVar("T")

OUTAGE = DatabaseOutage(
    None,
    logger=log,
    while_down="RPCs answer UNAVAILABLE and the loops wait until it is back",
    unit="failed RPCs and loop passes",
)
"""This process's controller outage tracker: RPCs (:func:`guard`) and the controller's loops
(:func:`loop_failed`) report to it, so an outage is one ERROR line and its end one WARNING
line (ended by the next successful leader-lease write), never a traceback per pass or RPC."""


REFUSAL_LOG_EVERY_S = 60.0
"""A refusal (401/403) with the same message is logged once per this many seconds: a flood
of bad join tokens on the join port must not fill the log."""
_refusals: dict[str, float] = {}
_refusals_lock = threading.Lock()


def _first_in_a_while(message: str) -> bool:
    now = time.monotonic()
    with _refusals_lock:
        last = _refusals.get(message)
        if last is not None and now - last < REFUSAL_LOG_EVERY_S:
            return False
        if len(_refusals) > 10_000:
            _refusals.clear()
        _refusals[message] = now
        return True


def loop_failed(what: str, exc: BaseException) -> None:
    """A controller loop pass failed with ``exc``: counted in :data:`OUTAGE` when the
    database is unreachable (no traceback), else logged with its traceback."""
    if _caused_by_outage(exc):
        OUTAGE.failed(exc)
        return
    log.error("%s failed", what, exc_info=exc)


def _caused_by_outage(exc: BaseException) -> bool:
    """An error raised while handling, or because of, an unreachable database."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 10:
        if isinstance(cur, SQLAlchemyError) and is_unavailable(cur):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def guard(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Map errors to a gRPC status in one place (no traceback crosses the wire): GpufleetError
    to INVALID_ARGUMENT / FAILED_PRECONDITION; the database unreachable to UNAVAILABLE and any
    other database error to INTERNAL, both with a generic message (the driver's names hosts,
    ports, users); the reason goes to the controller's log only."""
    try:
        return fn()
    except SQLAlchemyError as exc:
        if is_unavailable(exc):
            OUTAGE.failed(exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, "database unavailable; retry later")
        log.error("database error during an RPC", exc_info=exc)
        context.abort(grpc.StatusCode.INTERNAL, "internal error; see the controller log")
        raise  # unreachable: abort raises
    except GpufleetError as exc:
        code = {
            401: grpc.StatusCode.UNAUTHENTICATED,
            403: grpc.StatusCode.PERMISSION_DENIED,
            409: grpc.StatusCode.FAILED_PRECONDITION,
        }.get(exc.http_status, grpc.StatusCode.INVALID_ARGUMENT)
        if exc.http_status in (401, 403) and _first_in_a_while(exc.message):
            log.warning("refused a call from %s: %s", tls.peer_name(context), exc.message)
        context.abort(code, f"{exc.code}: {exc.message}")
        raise  # unreachable: abort raises
