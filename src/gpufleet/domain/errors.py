"""The one error tree. Each error carries a stable ``code``, an ``http_status``, whether the
caller may retry, and the request ``field`` it concerns (if any). The API maps it in one handler;
the gRPC servicer maps it in one place."""

from __future__ import annotations


class GpufleetError(Exception):
    """Base error. ``code`` is stable and machine-readable; ``str(err)`` is for people."""

    code: str = "internal_error"
    http_status: int = 500
    retryable: bool = False

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code


class ValidationFailed(GpufleetError):
    code = "validation_error"
    http_status = 422


class NotFound(GpufleetError):
    code = "not_found"
    http_status = 404


class Unauthenticated(GpufleetError):
    code = "unauthenticated"
    http_status = 401


class Forbidden(GpufleetError):
    code = "forbidden"
    http_status = 403


class Conflict(GpufleetError):
    code = "conflict"
    http_status = 409


class IdempotencyKeyReused(Conflict):
    code = "idempotency_key_reused_with_different_payload"


class LimitExceeded(GpufleetError):
    """A team limit (unfinished jobs, submit rate) refuses more work for now. ``field`` names
    the limit; ``retry_after_s`` is when a retry may succeed (the API's ``Retry-After``)."""

    code = "limit_exceeded"
    http_status = 429
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        retry_after_s: float = 1.0,
    ):
        super().__init__(message, field=field, code=code)
        self.retry_after_s = retry_after_s


class IllegalTransition(GpufleetError):
    """A state change that the transition table does not allow (a bug, or a stale writer)."""

    code = "illegal_transition"
    http_status = 409


class StaleState(GpufleetError):
    """A guarded write matched 0 rows: the row moved on (other status, token or epoch)."""

    code = "stale_state"
    http_status = 409
    retryable = True


class NotLeader(StaleState):
    """This controller does not hold the leader lease at the epoch it presented."""

    code = "not_leader"


class CapacityConflict(GpufleetError):
    """The conditional capacity update matched 0 rows: someone else took the GPUs first."""

    code = "capacity_conflict"
    http_status = 409
    retryable = True
