"""One short seed of the fault-injection harness (tests/chaos/harness.py) on real processes,
PostgreSQL and Redis. Long seeds: ``scripts/chaos.py --seeds 1-20 --duration 60``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.harness import run_chaos
from tests.conftest import PG_ADMIN_URL, REDIS_URL

SEED = int(os.environ.get("GPUFLEET_CHAOS_SEED", "7"))
DURATION_S = float(os.environ.get("GPUFLEET_CHAOS_DURATION_S", "60"))


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.postgres
@pytest.mark.timeout(480)  # start + 60 s of faults + heal + 90 s drain, on a busy box
def test_chaos_short_seed(tmp_path: Path) -> None:
    report = run_chaos(SEED, DURATION_S, tmp_path, PG_ADMIN_URL, REDIS_URL, drain_s=90)
    print(report.row())
    assert report.jobs > 20, report
    assert sum(report.faults.values()) >= 5, report
    assert report.ran > 0, report
    assert not report.violations, "\n".join(report.violations)
