"""Typed errors of the gpufleet SDK, built from the server's ``{error, message, field}`` body.

The tree, by HTTP status (the ``error`` code refines a few)::

    GpufleetClientError
     +- TransportError            the server could not be reached / the connection broke
     +- ArtifactMismatch          a downloaded artifact's size or sha256 is not the manifest's
     +- ApiError                  any 4xx/5xx answer: .status, .code, .message, .field
         +- BadRequest            400 (malformed JSON, bad query combination)
         +- AuthError             401/403
         |   +- Unauthenticated   401: missing, unknown or revoked token
         |   +- Forbidden         403: the token may not do this (admin only, other team)
         +- NotFound              404
         +- Conflict              409 (illegal transition, e.g. cancelling a finished job)
         |   +- IdempotencyConflict   the key was used with a different payload
         +- PayloadTooLarge       413
         +- ValidationError       422: .field names the bad request field
         +- RateLimited           429: .retry_after_s (from Retry-After)
         +- ServerError           5xx
             +- Unavailable       503 (database down): .retry_after_s
"""

from __future__ import annotations

from typing import Any


class GpufleetClientError(Exception):
    """Base of every error the SDK raises."""


class TransportError(GpufleetClientError):
    """The request did not get an answer: connection refused, DNS, timeout, broken stream.

    Attributes:
        url: the server's base URL.
    """

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.message, self.url = message, url


class ArtifactMismatch(GpufleetClientError):
    """A downloaded artifact does not match its manifest entry (size, sha256, or the server's
    ``X-Gpufleet-Sha256``); nothing was left at the destination.

    Attributes:
        path: the artifact's path in the manifest.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.message, self.path = message, path


class ApiError(GpufleetClientError):
    """The server answered with an error status.

    Attributes:
        status: the HTTP status (400..599).
        code: the server's stable error code (``not_found``, ``validation_error``...), or
            None when the body was not a gpufleet error (a proxy's HTML page, say).
        message: the server's sentence, meant for people.
        field: the request field the error concerns (``gpu_count``, ``Idempotency-Key``), or
            None.
        retry_after_s: seconds from the ``Retry-After`` header, or None.
    """

    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        field: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message + (f" (field: {field})" if field else ""))
        self.status, self.code, self.message = status, code, message
        self.field, self.retry_after_s = field, retry_after_s


class BadRequest(ApiError):
    """400: the request is malformed (invalid JSON body, conflicting query parameters)."""


class AuthError(ApiError):
    """401 or 403: the token is missing, unknown, revoked, or not allowed to do this."""


class Unauthenticated(AuthError):
    """401: missing, unknown or revoked token."""


class Forbidden(AuthError):
    """403: the token is valid but may not do this (admin-only call, another team's data)."""


class NotFound(ApiError):
    """404: no such job, attempt, node... (or one of another team)."""


class Conflict(ApiError):
    """409: the request conflicts with the current state (e.g. cancelling a finished job)."""


class IdempotencyConflict(Conflict):
    """409: the Idempotency-Key was already used with a different payload."""


class PayloadTooLarge(ApiError):
    """413: the request body is over the server's limit."""


class ValidationError(ApiError):
    """422: a field is invalid; ``field`` names it (``gpu_count``, ``Idempotency-Key``...)."""


class RateLimited(ApiError):
    """429: the team's submit or read rate, or its job limit; ``retry_after_s`` says when to
    retry (``wait()`` waits that long and polls again)."""


class ServerError(ApiError):
    """5xx: the server failed; see its log."""


class Unavailable(ServerError):
    """503: the server cannot reach its database; ``retry_after_s`` says when to retry."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthenticated,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationError,
    429: RateLimited,
    503: Unavailable,
}


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def error_from_response(
    status: int, body: Any, text: str, reason: str, retry_after: str | None = None
) -> ApiError:
    """The typed error for an error answer.

    Args:
        status: HTTP status (>= 400).
        body: the parsed JSON body, or None when it was not JSON.
        text: the raw body text (used when it is not a gpufleet error body).
        reason: the HTTP reason phrase.
        retry_after: the ``Retry-After`` header, if any.
    """
    if isinstance(body, dict) and body.get("message"):
        code, message, field = body.get("error"), str(body["message"]), body.get("field")
    elif isinstance(body, dict) and isinstance(body.get("detail"), str):  # plain FastAPI
        code, message, field = None, body["detail"], None
    else:
        code, field = None, None
        message = f"HTTP {status} from server: {text.strip()[:200] or reason}"
    if code == "idempotency_key_reused_with_different_payload":
        cls: type[ApiError] = IdempotencyConflict
    else:
        cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    return cls(
        status,
        str(code) if code is not None else None,
        message,
        str(field) if field is not None else None,
        _retry_after(retry_after),
    )
