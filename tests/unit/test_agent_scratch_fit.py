"""The size a default-size attempt's scratch filesystem gets on a short disk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpufleet.agent.scratch import MIN_SCRATCH_MB, default_fit_mb


def test_a_roomy_disk_gives_the_default() -> None:
    assert default_fit_mb(10240, 20480) == 10240
    assert default_fit_mb(10240, 100_000) == 10240


def test_a_short_disk_gives_half_the_room() -> None:
    # 9 GiB free, no other attempt: the first takes 4.5 GiB, the next still finds 2.25 GiB
    assert default_fit_mb(10240, 9216) == 4608
    assert default_fit_mb(10240, 9216 - 4608) == 2304


def test_a_tiny_room_gives_at_least_the_minimum_when_it_fits() -> None:
    assert default_fit_mb(10240, MIN_SCRATCH_MB + 4) == MIN_SCRATCH_MB
    assert default_fit_mb(10240, 5) == 5  # below the minimum: the caller refuses the start


@given(st.integers(min_value=1, max_value=1 << 20), st.integers(min_value=0, max_value=1 << 22))
def test_never_more_than_the_default_or_the_room(default_mb: int, room_mb: int) -> None:
    fit = default_fit_mb(default_mb, room_mb)
    assert fit <= default_mb and fit <= room_mb
    if room_mb < 2 * default_mb and room_mb >= 2 * MIN_SCRATCH_MB:
        assert fit <= room_mb // 2  # leaves at least as much for the next attempt
