"""Per-team admission limits of the REST API: submits per second (a token bucket) and
unfinished jobs (checked inside the submit transaction, ``services.jobs``).

Limits are on by default (``Settings.team_*``); a team's own value, set with ``admin team
set`` or ``PUT /v1/admin/teams/{team}``, overrides the default, and 0 means no limit.

The token bucket lives in Redis when ``GPUFLEET_REDIS_URL`` is set, so every API replica
draws from the same bucket (one Lua script: refill, take, expire, atomically, on the Redis
clock); in process otherwise. It is a guard, not a source of truth: when Redis cannot be
reached the replica falls back to its own in-process bucket (logged once per outage) rather
than refusing or admitting everything.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import select

from gpufleet.domain.errors import LimitExceeded
from gpufleet.domain.types import PriorityClass
from gpufleet.policy.limits import BudgetStatus, submit_warnings
from gpufleet.policy.limits import TeamLimits as PolicyTeamLimits
from gpufleet.queue.hint import DEFAULT_PREFIX, DEFAULT_TIMEOUT_S, shared_hint
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import TeamRow
from gpufleet.store.team_limits import limits_from_json, team_budgets

if TYPE_CHECKING:
    from gpufleet.settings import Settings
    from gpufleet.store.db import Database

log = logging.getLogger("gpufleet.api")

# sanity bounds of a team's quota and limits (a typo must not become 1e308 GPUs)
MAX_WEIGHT = 1_000_000.0
MIN_WEIGHT = 1 / MAX_WEIGHT
"""The smallest team weight: weights span twelve orders of magnitude, no more (a subnormal
weight would make every dominant share infinite; the policy clamps at 1e-9 anyway)."""
MAX_GPUS = 1_000_000
MAX_GPU_TYPES = 64
MAX_OUTSTANDING_JOBS = 10_000_000
MAX_SUBMIT_RATE_PER_S = 100_000.0
MAX_SUBMIT_BURST = 1_000_000
MAX_RUNTIME_S = 366 * 24 * 3600.0
"""The largest team default or limit of ``max_runtime_s`` (a year), seconds."""
MIN_RUNTIME_S = 1.0
"""The smallest team default or limit of ``max_runtime_s`` other than 0 (none), seconds: a
limit of 1e-300 s is a typo, not a policy."""

LIMITS_TTL_S = 1.0
"""A team's limits are remembered this long per server: a change applies within it."""
BUDGETS_TTL_S = 5.0
"""A team's budget use, as ``submit``'s warnings read it, is remembered this long per
server (a team submitting thousands of jobs does not sum its ledger for each)."""


_NO_CLASS_LIMITS = PolicyTeamLimits()  # frozen: one shared value


@dataclass(frozen=True, slots=True)
class TeamLimits:
    """A team's effective limits; 0 = no limit.

    Attributes:
        max_outstanding_jobs: unfinished (not terminal) jobs allowed.
        submit_rate_per_s: token-bucket refill, submits per second.
        submit_burst: token-bucket size, submits allowed at once.
        runtime: the team's (default_max_runtime_s, max_runtime_limit_s), seconds or None
            each (``services.job_admission.apply_runtime_limits``); None = not read.
        read_rate_per_s: read token-bucket refill (GET requests of the API), per second.
        read_burst: read token-bucket size.
        notify_urls: the team's default webhook URLs (``teams.notify_urls``), given to a job
            submitted without ``notify``.
        classes: the team's ``teams.limits`` (allowed priority classes, budgets:
            ``policy.limits``); the default limits nothing.
    """

    max_outstanding_jobs: int
    submit_rate_per_s: float
    submit_burst: int
    runtime: tuple[float | None, float | None] | None = None
    read_rate_per_s: float = 0.0
    read_burst: int = 1
    notify_urls: tuple[str, ...] = ()
    classes: PolicyTeamLimits = _NO_CLASS_LIMITS

    @staticmethod
    def defaults(settings: Settings) -> TeamLimits:
        return TeamLimits(
            settings.team_max_outstanding_jobs,
            settings.team_submit_rate_per_s,
            settings.team_submit_burst,
            read_rate_per_s=settings.team_read_rate_per_s,
            read_burst=settings.team_read_burst,
        )

    def for_team(
        self,
        max_outstanding_jobs: int | None,
        submit_rate_per_s: float | None,
        submit_burst: int | None,
        default_max_runtime_s: float | None = None,
        max_runtime_limit_s: float | None = None,
        read_rate_per_s: float | None = None,
        read_burst: int | None = None,
        notify_urls: list[str] | None = None,
        limits: Mapping[str, Any] | None = None,
    ) -> TeamLimits:
        """These defaults overridden by a team's own values (None = keep the default)."""
        return TeamLimits(
            self.max_outstanding_jobs if max_outstanding_jobs is None else max_outstanding_jobs,
            self.submit_rate_per_s if submit_rate_per_s is None else submit_rate_per_s,
            self.submit_burst if submit_burst is None else submit_burst,
            (default_max_runtime_s, max_runtime_limit_s),
            self.read_rate_per_s if read_rate_per_s is None else read_rate_per_s,
            self.read_burst if read_burst is None else read_burst,
            tuple(notify_urls or ()),
            limits_from_json(limits),
        )


class RateLimiter(Protocol):
    def take(self, key: str, rate_per_s: float, burst: int, cost: int = 1) -> float:
        """Take ``cost`` tokens from bucket ``key`` (refilled at ``rate_per_s`` up to
        ``burst``). Returns 0.0 when taken, else the seconds until they are available (nothing
        taken)."""

    def needs_io(self) -> bool:
        """Whether :meth:`take` may block on the network (then it runs off the event loop)."""


class InProcRateLimiter:
    """Token buckets in this process (one API replica, or the fallback when Redis is down)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str, rate_per_s: float, burst: int, cost: int = 1) -> float:
        now = self._clock()
        cost = max(1, min(cost, burst))
        with self._lock:
            tokens, at = self._buckets.get(key, (float(burst), now))
            tokens = min(float(burst), tokens + max(0.0, now - at) * rate_per_s)
            wait = 0.0
            if tokens >= cost:
                tokens -= cost
            else:
                wait = (cost - tokens) / rate_per_s
            if len(self._buckets) > 100_000:  # idle buckets are full again: forget them
                self._buckets.clear()
            self._buckets[key] = (tokens, now)
            return wait

    def needs_io(self) -> bool:
        return False


# KEYS[1]: bucket; ARGV: rate per second, burst, cost. Returns the wait in seconds as a
# string ("0" = taken). Time comes from the Redis server, the one clock every replica shares.
# The stored state is bounded on read: anyone who can write the key (a leaked password, a job
# that reached Redis) may put anything there, and it must not lock a team out: tokens that
# are not a number or are below 0 count as a full bucket, above the burst as the burst; a
# timestamp that is not a number or lies in the future counts as now.
_TAKE_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1])
local ts = tonumber(b[2])
if tokens == nil or tokens ~= tokens or tokens < 0 then
  tokens = burst
end
if tokens > burst then
  tokens = burst
end
if ts == nil or ts ~= ts or ts > now then
  ts = now
end
tokens = math.min(burst, tokens + (now - ts) * rate)
local wait = 0
if tokens >= cost then
  tokens = tokens - cost
else
  wait = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


class RedisRateLimiter:
    """Token buckets shared by every API replica: one Lua script per take (a round trip),
    keys ``{prefix}:rate:{bucket}``.

    Fails open to per-replica limits: when Redis does not answer within the hint's timeout
    the breaker (:class:`~gpufleet.queue.hint.RedisHint`) opens and each replica limits with
    its own in-process bucket until Redis answers again, so a team may get up to N times its
    rate across N replicas during an outage, never a refusal caused by Redis. A bucket key of
    the wrong type (written by someone else) is deleted and the take retried: no outage.

    Args:
        url: ``redis://[user:password@]host:port/db`` or ``rediss://``.
        prefix: the deployment's namespace (``GPUFLEET_REDIS_PREFIX``).
        timeout_s: the Redis command timeout, seconds.
    """

    def __init__(
        self, url: str, prefix: str = DEFAULT_PREFIX, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._hint = shared_hint(url, prefix=prefix, timeout_s=timeout_s)
        self._script = self._hint.client.register_script(_TAKE_LUA)
        self._fallback = InProcRateLimiter()

    def take(self, key: str, rate_per_s: float, burst: int, cost: int = 1) -> float:
        cost = max(1, min(cost, burst))
        bucket = self._hint.key(f"rate:{key}")
        ok, raw = self._hint.call(
            "rate limit",
            lambda _r: self._script(keys=[bucket], args=[repr(rate_per_s), burst, cost]),
            # a bucket key someone overwrote with another type (WRONGTYPE): drop it, retake
            repair=lambda r: r.delete(bucket),
        )
        if not ok:
            return self._fallback.take(key, rate_per_s, burst, cost)
        try:
            wait = float(raw.decode() if isinstance(raw, bytes) else str(raw))
        except (TypeError, ValueError):
            return self._fallback.take(key, rate_per_s, burst, cost)
        # never longer than an empty bucket's refill, whatever the store said
        return min(max(0.0, wait), cost / rate_per_s) if wait == wait else 0.0

    def needs_io(self) -> bool:
        return not self._hint.is_open  # an open breaker answers at once

    def close(self) -> None:
        self._hint.close()


def make_rate_limiter(
    redis_url: str | None, *, prefix: str = DEFAULT_PREFIX, timeout_s: float = DEFAULT_TIMEOUT_S
) -> RateLimiter:
    """A :class:`RedisRateLimiter` when ``redis_url`` is set, else in-process buckets."""
    if not redis_url:
        return InProcRateLimiter()
    return RedisRateLimiter(redis_url, prefix=prefix, timeout_s=timeout_s)


class SubmitAdmission:
    """The submit-rate check of ``POST /v1/jobs``, with each team's limits cached for
    ``LIMITS_TTL_S``.

    Args:
        db: where the teams' own limits are read.
        limiter: the token buckets.
        defaults: the server's default limits.
    """

    def __init__(self, db: Database, limiter: RateLimiter, defaults: TeamLimits) -> None:
        self.db, self.limiter, self.defaults = db, limiter, defaults
        self._cache: dict[str, tuple[float, TeamLimits]] = {}
        self._budgets: dict[str, tuple[float, float, tuple[BudgetStatus, ...]]] = {}
        """team -> (monotonic read time, database time then, its budgets)."""
        self._lock = threading.Lock()

    def limits(self, team_id: str) -> TeamLimits:
        """The team's effective limits (cached for ``LIMITS_TTL_S``)."""
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(team_id)
        if hit is not None and now - hit[0] < LIMITS_TTL_S:
            return hit[1]
        with self.db.read() as s:
            row = s.execute(
                select(
                    TeamRow.max_outstanding_jobs,
                    TeamRow.submit_rate_per_s,
                    TeamRow.submit_burst,
                    TeamRow.default_max_runtime_s,
                    TeamRow.max_runtime_limit_s,
                    TeamRow.read_rate_per_s,
                    TeamRow.read_burst,
                    TeamRow.notify_urls,
                    TeamRow.limits,
                ).where(TeamRow.id == team_id)
            ).first()
        limits = self.defaults if row is None else self.defaults.for_team(*row)
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[team_id] = (now, limits)
        return limits

    def budget_warnings(self, team_id: str, priority: PriorityClass) -> list[str]:
        """The warnings ``submit`` answers for a job of ``priority`` of ``team_id``
        (``policy.limits.submit_warnings``: soft budgets at 80% / 100%, exhausted hard and
        class budgets). Teams without budgets cost nothing (their cached limits say so);
        the others' budgets are read at most every ``BUDGETS_TTL_S`` per server."""
        rules = self.limits(team_id).classes
        if not rules.gpu_budgets and not rules.class_budgets:
            return []
        now = time.monotonic()
        with self._lock:
            hit = self._budgets.get(team_id)
        if hit is None or now - hit[0] >= BUDGETS_TTL_S:
            with self.db.read() as s:
                at = db_now(s).timestamp()
                hit = (now, at, tuple(team_budgets(s, team_id, at)))
            with self._lock:
                if len(self._budgets) > 10_000:
                    self._budgets.clear()
                self._budgets[team_id] = hit
        return submit_warnings(hit[2], priority, hit[1] + (now - hit[0]))

    def check_needs_io(self, team_id: str, *, read: bool = False) -> bool:
        """Whether :meth:`check_submit_rate` (``read``: :meth:`check_read_rate`) for
        ``team_id`` may block: the team's limits are not cached, or its rate is limited
        through a shared (Redis) bucket that is answering. When False the check is a few dict
        operations, cheap enough for an event loop."""
        with self._lock:
            hit = self._cache.get(team_id)
        if hit is None or time.monotonic() - hit[0] >= LIMITS_TTL_S:
            return True
        rate = hit[1].read_rate_per_s if read else hit[1].submit_rate_per_s
        return rate > 0 and self.limiter.needs_io()

    def forget(self, team_id: str) -> None:
        """Drop a team's cached limits (they were changed through this server)."""
        with self._lock:
            self._cache.pop(team_id, None)
            self._budgets.pop(team_id, None)

    def check_submit_rate(self, team_id: str) -> None:
        """Take one submit from the team's bucket.

        Raises:
            LimitExceeded: over the team's submit rate (429; ``retry_after_s`` set, field
                ``submit_rate_per_s``).
        """
        lim = self.limits(team_id)
        if lim.submit_rate_per_s <= 0:
            return
        wait = self.limiter.take(f"submit:{team_id}", lim.submit_rate_per_s, lim.submit_burst)
        if wait > 0:
            raise LimitExceeded(
                f"team {team_id!r} is over its submit rate limit "
                f"({lim.submit_rate_per_s:g}/s, burst {lim.submit_burst}); "
                f"retry in {wait:.2f} s",
                field="submit_rate_per_s",
                retry_after_s=wait,
            )

    def check_read_rate(self, team_id: str, cost: int = 1) -> None:
        """Take ``cost`` tokens from the team's read bucket (every GET of the API).

        Raises:
            LimitExceeded: over the team's read rate (429; ``retry_after_s`` set, field
                ``read_rate_per_s``).
        """
        lim = self.limits(team_id)
        if lim.read_rate_per_s <= 0:
            return
        wait = self.limiter.take(f"read:{team_id}", lim.read_rate_per_s, lim.read_burst, cost)
        if wait > 0:
            raise LimitExceeded(
                f"team {team_id!r} is over its read rate limit "
                f"({lim.read_rate_per_s:g} tokens/s, burst {lim.read_burst}; a read costs 1 token,"
                f" a job list 1 per {READ_ROWS_PER_TOKEN} rows asked for); retry in {wait:.2f} s",
                field="read_rate_per_s",
                retry_after_s=wait,
            )


READ_ROWS_PER_TOKEN = 20
"""A job list costs one token of the team's read bucket per this many rows it asks for
(``?limit=``, default 50: 3 tokens; 500: 25); any other read costs one. Serving a row (ORM and
the response model) is most of a list's CPU time, so the bucket meters rows, not requests."""


def read_cost(limit: int | None) -> int:
    """Tokens a read takes: 1, or ``ceil(limit / READ_ROWS_PER_TOKEN)`` for a job list."""
    if limit is None or limit <= READ_ROWS_PER_TOKEN:
        return 1
    return -(-limit // READ_ROWS_PER_TOKEN)


def retry_after_header(seconds: float) -> str:
    """An HTTP ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
