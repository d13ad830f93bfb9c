"""One mapping of errors to gRPC statuses for every controller service (no traceback, host
name or driver message crosses the wire)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from sqlalchemy.exc import SQLAlchemyError

from gpufleet.domain.errors import GpufleetError
from gpufleet.rpc import tls
from gpufleet.store.db import is_unavailable, short_reason

log = logging.getLogger("gpufleet.controller")
T = TypeVar("T")

UNAVAILABLE_LOG_EVERY_S = 30.0
"""While the database is down, one log line per this many seconds, not one per RPC."""
_unavailable_logged_at = -UNAVAILABLE_LOG_EVERY_S


def guard(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Map errors to a gRPC status in one place (no traceback crosses the wire): GpufleetError
    to INVALID_ARGUMENT / FAILED_PRECONDITION; the database unreachable to UNAVAILABLE and any
    other database error to INTERNAL, both with a generic message (the driver's names hosts,
    ports, users); the reason goes to the controller's log only."""
    try:
        return fn()
    except SQLAlchemyError as exc:
        if is_unavailable(exc):
            global _unavailable_logged_at
            if time.monotonic() - _unavailable_logged_at > UNAVAILABLE_LOG_EVERY_S:
                _unavailable_logged_at = time.monotonic()
                log.warning("database unavailable during RPCs: %s", short_reason(exc))
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
        if exc.http_status in (401, 403):
            log.warning("refused a call from %s: %s", tls.peer_name(context), exc.message)
        context.abort(code, f"{exc.code}: {exc.message}")
        raise  # unreachable: abort raises
