"""The Redis circuit breaker and the in-process token bucket, without a Redis server: a
refused connection (a closed loopback port) opens the breaker, calls are then skipped at once
until ``open_s`` has passed, and the outage is logged once."""

from __future__ import annotations

import logging

import pytest

from gpufleet.queue.hint import RedisHint, _safe_url
from gpufleet.services.limits import InProcRateLimiter, read_cost
from tests.ports import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failure_opens_the_breaker_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    hint = RedisHint(f"redis://127.0.0.1:{free_port()}/0", open_s=10.0, clock=clock)
    calls = []

    def ping(r: object) -> bool:
        calls.append(1)
        return bool(r.ping())  # type: ignore[attr-defined]

    with caplog.at_level(logging.WARNING, logger="gpufleet.redis"):
        assert hint.call("ping", ping) == (False, None)
        assert hint.is_open
        for _ in range(50):
            assert hint.call("ping", ping) == (False, None)
        assert len(calls) == 1  # skipped while open
        clock.now += 10.5
        assert hint.call("ping", ping) == (False, None)  # one probe, failed again
        assert len(calls) == 2
    assert len([r for r in caplog.records if "unreachable" in r.message]) == 1


def test_keys_are_under_the_prefix() -> None:
    assert RedisHint("redis://127.0.0.1:1/0", prefix="prod-a:").key("wake") == "prod-a:wake"


def test_urls_in_logs_hide_the_password() -> None:
    assert _safe_url("rediss://app:s3cret@redis:6380/0") == "rediss://app:***@redis:6380/0"
    assert _safe_url("redis://:s3cret@redis/0") == "redis://***@redis/0"
    assert _safe_url("redis://redis:6379/0") == "redis://redis:6379/0"


def test_a_read_takes_its_cost_and_a_list_costs_per_20_rows() -> None:
    clock = Clock()
    bucket = InProcRateLimiter(clock=clock)
    assert (read_cost(None), read_cost(20), read_cost(50), read_cost(500)) == (1, 1, 3, 25)
    assert bucket.take("read:a", 2.0, 30, cost=25) == 0.0
    wait = bucket.take("read:a", 2.0, 30, cost=25)
    assert wait == pytest.approx((25 - 5) / 2.0)
    clock.now += wait
    assert bucket.take("read:a", 2.0, 30, cost=25) == 0.0
    # a cost above the burst is capped at the burst (it must be payable at all)
    assert bucket.take("read:b", 1.0, 10, cost=1000) == 0.0
