"""The in-process token bucket on a manual clock (the Redis one is tested against real
Redis in tests/integration/test_api_limits.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpufleet.services.limits import InProcRateLimiter, TeamLimits, retry_after_header


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestTokenBucket:
    def test_burst_then_refused_with_the_wait_until_the_next_token(self) -> None:
        clock = Clock()
        rl = InProcRateLimiter(clock)
        assert [rl.take("t", 2.0, 3) for _ in range(3)] == [0.0, 0.0, 0.0]
        assert rl.take("t", 2.0, 3) == pytest.approx(0.5)
        clock.now += 0.25
        assert rl.take("t", 2.0, 3) == pytest.approx(0.25)  # a refusal takes nothing
        clock.now += 0.25
        assert rl.take("t", 2.0, 3) == 0.0

    def test_refill_is_capped_at_the_burst(self) -> None:
        clock = Clock()
        rl = InProcRateLimiter(clock)
        rl.take("t", 1.0, 2)
        clock.now += 3600
        assert [rl.take("t", 1.0, 2) > 0 for _ in range(3)] == [False, False, True]

    def test_buckets_are_per_key(self) -> None:
        rl = InProcRateLimiter(Clock())
        assert rl.take("a", 1.0, 1) == 0.0
        assert rl.take("a", 1.0, 1) > 0
        assert rl.take("b", 1.0, 1) == 0.0


@pytest.mark.parametrize(("seconds", "want"), [(0.001, "1"), (1.0, "1"), (1.2, "2"), (30.0, "30")])
def test_retry_after_is_whole_seconds_at_least_one(seconds: float, want: str) -> None:
    assert retry_after_header(seconds) == want


def test_a_team_value_overrides_the_default_and_none_keeps_it() -> None:
    defaults = TeamLimits(10_000, 100.0, 500)
    # (runtime: the team's own run-time settings, read with its limits: none here)
    assert defaults.for_team(None, None, None) == replace(defaults, runtime=(None, None))
    assert defaults.for_team(0, 5.0, None) == TeamLimits(0, 5.0, 500, (None, None))
