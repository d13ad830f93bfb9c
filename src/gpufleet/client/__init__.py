"""gpufleet's Python SDK: a typed client of the REST API, sync and async (httpx).

    from gpufleet.client import Client

    with Client() as fleet:                     # URL and token as the CLI finds them
        job = fleet.submit(["python3", "train.py"], gpus=2, name="train")
        done = fleet.wait(job)                  # polls until terminal
        print(done.status, done.exit_code)
        print(fleet.logs(job, tail=20))

Errors are typed (:mod:`gpufleet.client.errors`): ``NotFound``, ``Conflict``,
``RateLimited`` (``.retry_after_s``), ``AuthError``, ``ValidationError`` (``.field``),
``ServerError``, ``TransportError``; all derive from ``GpufleetClientError``.
"""

from typing import TYPE_CHECKING, Any

from gpufleet.client.config import ConfigError
from gpufleet.client.errors import (
    ApiError,
    AuthError,
    BadRequest,
    Conflict,
    Forbidden,
    GpufleetClientError,
    IdempotencyConflict,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    TransportError,
    Unauthenticated,
    Unavailable,
    ValidationError,
)
from gpufleet.client.models import (
    TERMINAL_STATES,
    Attempt,
    Job,
    JobPage,
    Node,
    PendingReason,
    Submitted,
)

if TYPE_CHECKING:
    from gpufleet.client._async import AsyncClient
    from gpufleet.client._sync import Client


def __getattr__(name: str) -> Any:
    # the clients (and httpx, asyncio) load on first use: the CLI imports this package's
    # errors and models on every call and must stay cheap to start
    if name == "Client":
        from gpufleet.client._sync import Client

        return Client
    if name == "AsyncClient":
        from gpufleet.client._async import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'gpufleet.client' has no attribute {name!r}")


__all__ = [
    "TERMINAL_STATES",
    "ApiError",
    "AsyncClient",
    "Attempt",
    "AuthError",
    "BadRequest",
    "Client",
    "ConfigError",
    "Conflict",
    "Forbidden",
    "GpufleetClientError",
    "IdempotencyConflict",
    "Job",
    "JobPage",
    "Node",
    "NotFound",
    "PayloadTooLarge",
    "PendingReason",
    "RateLimited",
    "ServerError",
    "Submitted",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "ValidationError",
]
