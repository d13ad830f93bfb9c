"""One Redis client per process and URL, behind a circuit breaker: Redis is a hint (shared
rate-limit buckets, scheduler wake-ups), so no request may wait on it for long and no process
may need it to start.

- Every command has one short timeout (``timeout_s``, seconds: connect and read alike).
- The first failure (refused, timed out, bad password, anything) opens the breaker: for
  ``open_s`` seconds every call is skipped at once and its caller falls back (the in-process
  limiter, the scheduler's tick). One warning is logged when the outage starts and one line
  when a probe succeeds again; the calls skipped in between log nothing.
- A request that meets a hung Redis so waits one timeout at most, whatever number of Redis
  calls it makes (the first failure opens the breaker for the calls after it).
- An error *reply* (``ResponseError``: a key of the wrong type, a script error) is no outage:
  Redis answered. The breaker stays as it is; the caller may repair (``repair``: e.g. delete
  the bad key) and retry once, else that one call falls back. Anyone able to write one key so
  cannot keep every replica off Redis. Logged at most once a minute per kind of call.

Keys and channels are named under a per-deployment prefix (``GPUFLEET_REDIS_PREFIX``), so that
deployments sharing one Redis neither see each other's buckets nor wake each other's
schedulers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("gpufleet.redis")

T = TypeVar("T")

DEFAULT_PREFIX = "gpufleet"
DEFAULT_TIMEOUT_S = 0.25
DEFAULT_OPEN_S = 10.0
REPLY_ERROR_LOG_S = 60.0
"""At most one log line per this many seconds, per kind of call, for Redis error replies."""


class RedisHint:
    """A Redis client whose failures open a circuit breaker instead of reaching the caller.

    Args:
        url: ``redis://[user:password@]host:port/db`` or ``rediss://`` (TLS).
        prefix: the deployment's namespace; keys are ``{prefix}:{name}``.
        timeout_s: connect and command timeout, seconds.
        open_s: how long the breaker stays open after a failure, seconds.
        clock: monotonic seconds (tests).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        open_s: float = DEFAULT_OPEN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis

        self.url = url
        self.prefix = prefix.rstrip(":")
        self.timeout_s = timeout_s
        self.open_s = open_s
        self._clock = clock
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None: closed (Redis answering)
        self._probing = False
        self._reply_error = redis.exceptions.ResponseError
        self._reply_logged: dict[str, float] = {}

    def key(self, name: str) -> str:
        """The Redis key or channel of ``name`` in this deployment's namespace."""
        return f"{self.prefix}:{name}"

    @property
    def is_open(self) -> bool:
        """True while calls are being skipped (an outage is in progress)."""
        with self._lock:
            return self._open_until is not None

    def call(
        self,
        what: str,
        fn: Callable[[Any], T],
        *,
        repair: Callable[[Any], object] | None = None,
    ) -> tuple[bool, T | None]:
        """Run ``fn(client)`` unless the breaker is open.

        Args:
            repair: run as ``repair(client)`` when Redis answers ``fn`` with an error reply
                (``ResponseError``, e.g. WRONGTYPE), then ``fn`` is retried once.

        Returns:
            (True, result) when Redis answered; (False, None) when the call was skipped or
            failed (the caller falls back). Never raises for a Redis failure. An error reply
            (after ``repair``, if given) falls back for this call only: the breaker is not
            opened by it.
        """
        with self._lock:
            if self._open_until is not None:
                if self._probing or self._clock() < self._open_until:
                    return False, None
                self._probing = True  # one caller probes; the others keep skipping
        try:
            try:
                result = fn(self.client)
            except self._reply_error as exc:  # Redis answered: a bad key, not an outage
                if repair is None:
                    raise
                self._log_reply_error(what, exc, repaired=True)
                repair(self.client)
                result = fn(self.client)
        except self._reply_error as exc:
            self._log_reply_error(what, exc, repaired=False)
            self._succeeded()
            return False, None
        except Exception as exc:  # any Redis failure (refused, timeout, auth): fall back
            self._failed(what, exc)
            return False, None
        self._succeeded()
        return True, result

    def _log_reply_error(self, what: str, exc: Exception, *, repaired: bool) -> None:
        now = self._clock()
        with self._lock:
            last = self._reply_logged.get(what)
            if last is not None and now - last < REPLY_ERROR_LOG_S:
                return
            self._reply_logged[what] = now
        log.warning(
            "Redis %s answered an error during %s (%s: %s): not an outage; %s",
            _safe_url(self.url),
            what,
            type(exc).__name__,
            str(exc)[:200],
            "repairing the key and retrying" if repaired else "this call falls back",
        )

    def _failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            started = self._open_until is None
            self._open_until = self._clock() + self.open_s
            self._probing = False
        if started:
            log.warning(
                "Redis %s unreachable (%s: %s, during %s); rate limits per process and "
                "scheduler wake-ups by tick until it answers (next try in %.0f s)",
                _safe_url(self.url),
                type(exc).__name__,
                str(exc)[:200],
                what,
                self.open_s,
            )

    def _succeeded(self) -> None:
        with self._lock:
            ended = self._open_until is not None
            self._open_until = None
            self._probing = False
        if ended:
            log.warning(
                "Redis %s answers again; shared limits and wake-ups resume", _safe_url(self.url)
            )

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a client of a dead server
            self.client.close()


def _safe_url(url: str) -> str:
    """``url`` without its password (logs never carry a credential)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    auth, _, host = rest.rpartition("@")
    user = auth.partition(":")[0]
    return f"{scheme}://{user + ':***@' if user else '***@'}{host}"


_shared: dict[tuple[str, str, float, float], RedisHint] = {}
_shared_lock = threading.Lock()


def shared_hint(
    url: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    open_s: float = DEFAULT_OPEN_S,
) -> RedisHint:
    """The process's one :class:`RedisHint` for these arguments (the limiter and the waker of
    a server share it, so that one outage opens one breaker and logs once)."""
    key = (url, prefix, timeout_s, open_s)
    with _shared_lock:
        hint = _shared.get(key)
        if hint is None:
            hint = _shared[key] = RedisHint(url, prefix=prefix, timeout_s=timeout_s, open_s=open_s)
        return hint
