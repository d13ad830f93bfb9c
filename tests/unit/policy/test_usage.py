"""Usage is charged per attempt for the GPU-time it held, across retries and preemptions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.policy.usage import UsageLedger, interval_gpu_s


class TestUsageLedger:
    @pytest.mark.parametrize(
        ("attempts", "want_gpu_s"),
        [
            pytest.param([(2, 0.0, 300.0)], 600.0, id="one clean attempt"),
            pytest.param(
                [(2, 0.0, 100.0), (2, 500.0, 800.0)], 800.0, id="failed then retried: both paid"
            ),
            pytest.param(
                [(8, 0.0, 50.0), (8, 1000.0, 1000.0)], 400.0, id="preempted then never started"
            ),
        ],
    )
    def test_retry_charges_only_real_gpu_time(
        self, attempts: list[tuple[int, float, float]], want_gpu_s: float
    ) -> None:
        ledger = UsageLedger(half_life_s=math.inf)
        for gpus, start, end in attempts:
            ledger.charge_attempt(gpus, start, end)
        assert ledger.at(10_000.0) == pytest.approx(want_gpu_s)

    @given(
        st.integers(1, 8),
        st.floats(0, 1e6),
        st.lists(st.floats(1, 1e5), min_size=1, max_size=6),
    )
    def test_splitting_an_attempt_changes_nothing(
        self, gpus: int, start: float, pieces: list[float]
    ) -> None:
        """Charging a run in pieces (e.g. across checkpoints) equals charging it whole."""
        half_life = 86_400.0
        end = start + sum(pieces)
        whole = UsageLedger(half_life_s=half_life)
        whole.charge_attempt(gpus, start, end)
        parts = UsageLedger(half_life_s=half_life)
        t = start
        for p in pieces:
            parts.charge_attempt(gpus, t, t + p)
            t += p
        assert parts.at(end + 10) == pytest.approx(whole.at(end + 10), rel=1e-6)

    def test_decay_halves_in_one_half_life(self) -> None:
        ledger = UsageLedger(half_life_s=100.0)
        ledger.charge_attempt(1, 0.0, 1.0)
        v = ledger.at(1.0)
        assert ledger.at(101.0) == pytest.approx(v / 2)
        assert interval_gpu_s(1, 0, 1, 1, 100.0) == pytest.approx(v)
