"""An error reply of the real Redis (db 15) is no outage: a rate-limit key overwritten with a
string (``SET {prefix}:rate:submit:b x``: WRONGTYPE) is repaired by the limiter, which keeps
using Redis, and no call opens the breaker or logs "unreachable"."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
import redis

from gpufleet.queue.hint import RedisHint
from gpufleet.services.limits import RedisRateLimiter
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.slow, pytest.mark.redis]


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"gftest-{uuid.uuid4().hex[:8]}"
    yield p
    r = redis.Redis.from_url(REDIS_URL)
    for key in r.scan_iter(f"{p}:*"):
        r.delete(key)


def test_a_bucket_key_of_the_wrong_type_is_repaired_without_opening_the_breaker(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    r.set(f"{prefix}:rate:submit:b", "x")
    limiter = RedisRateLimiter(REDIS_URL, prefix=prefix)
    with caplog.at_level(logging.WARNING, logger="gpufleet.redis"):
        assert limiter.take("submit:b", 1.0, 5) == 0.0
        assert not limiter._hint.is_open
        # the key is a bucket again, in Redis, with the token just taken
        assert r.type(f"{prefix}:rate:submit:b") == b"hash"
        assert float(r.hget(f"{prefix}:rate:submit:b", "tokens") or b"nan") == pytest.approx(
            4.0, abs=0.01
        )
        # poisoned again at every take: each take repairs, the bucket stays shared
        for _ in range(3):
            r.set(f"{prefix}:rate:submit:b", "x")
            assert limiter.take("submit:b", 1.0, 5) == 0.0
            assert not limiter._hint.is_open
        for _ in range(4):
            limiter.take("submit:c", 1.0, 5)
        assert float(r.hget(f"{prefix}:rate:submit:c", "tokens") or b"nan") < 2.0
    assert not [m for m in caplog.messages if "unreachable" in m], caplog.messages
    assert len([m for m in caplog.messages if "not an outage" in m]) == 1  # once a minute


def test_an_error_reply_without_repair_falls_back_for_that_call_only(prefix: str) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    r.set(f"{prefix}:s", "x")
    hint = RedisHint(REDIS_URL, prefix=prefix)
    assert hint.call("read", lambda c: c.hget(f"{prefix}:s", "f")) == (False, None)
    assert not hint.is_open
    assert hint.call("ping", lambda c: c.ping()) == (True, True)
    hint.close()
