"""gpufleet's Python SDK: a typed client of the REST API, sync and async (httpx).

    from gpufleet.client import Client

    with Client() as fleet:                     # URL and token as the CLI finds them
        job = fleet.submit(["python3", "train.py"], gpus=2, name="train")
        done = fleet.wait(job)                  # polls until terminal
        print(done.status, done.exit_code)
        print(fleet.logs(job, tail=20))
        prep = fleet.submit("python3 prep.py", array="0-3%2")      # 4 tasks, 2 at a time
        fleet.submit("python3 merge.py", depends_on=prep.job_ids)  # afterok on every task
        print(fleet.usage(since="2026-11-01").hours_by_key())      # GPU-hours per team

Errors are typed (:mod:`gpufleet.client.errors`): ``NotFound``, ``Conflict``,
``RateLimited`` (``.retry_after_s``), ``AuthError``, ``ValidationError`` (``.field``),
``ServerError``, ``TransportError``; all derive from ``GpufleetClientError``.
"""

from typing import TYPE_CHECKING, Any

from gpufleet.client.config import ConfigError
from gpufleet.client.errors import (
    ApiError,
    ArtifactMismatch,
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

if TYPE_CHECKING:
    from gpufleet.client._async import AsyncClient
    from gpufleet.client._sync import Client
    from gpufleet.client.models import (
        TERMINAL_STATES,
        ArrayInfo,
        ArrayTask,
        Artifact,
        ArtifactList,
        Attempt,
        CancelResult,
        Job,
        JobPage,
        Node,
        PendingReason,
        StartEstimate,
        Submitted,
        UsageLine,
        UsageReport,
    )

_MODELS = frozenset(
    {
        "TERMINAL_STATES",
        "ArrayInfo",
        "ArrayTask",
        "Artifact",
        "ArtifactList",
        "Attempt",
        "CancelResult",
        "Job",
        "JobPage",
        "Node",
        "PendingReason",
        "StartEstimate",
        "Submitted",
        "UsageLine",
        "UsageReport",
    }
)


def __getattr__(name: str) -> Any:
    # the clients (and httpx, asyncio) and the models (~14 dataclasses, ~10 ms to build) load
    # on first use: the CLI imports this package's errors on every call and must start cheaply
    if name == "Client":
        from gpufleet.client._sync import Client

        return Client
    if name == "AsyncClient":
        from gpufleet.client._async import AsyncClient

        return AsyncClient
    if name in _MODELS:
        from gpufleet.client import models

        return getattr(models, name)
    raise AttributeError(f"module 'gpufleet.client' has no attribute {name!r}")


__all__ = [
    "TERMINAL_STATES",
    "ApiError",
    "ArrayInfo",
    "ArrayTask",
    "Artifact",
    "ArtifactList",
    "ArtifactMismatch",
    "AsyncClient",
    "Attempt",
    "AuthError",
    "BadRequest",
    "CancelResult",
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
    "StartEstimate",
    "Submitted",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "UsageLine",
    "UsageReport",
    "ValidationError",
]
