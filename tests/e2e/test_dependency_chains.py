"""``afternotok`` chains with real processes (issue 24, item 10): "not ok" means the job ran
and did not succeed. A retry-until-success chain stops after its first success (on main it
alternated FAILED, SUCCEEDED, DEPENDENCY_FAILED, SUCCEEDED, ... because DEPENDENCY_FAILED
counted as "not ok"), and a job cancelled before it ever ran does not release its
``afternotok`` dependant (Flux #6565's rule)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import TERMINAL, Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path).start(teams=("vision",))
    try:
        f.start_agent("a1", gpus="2xH100-80GB")
        yield f
    finally:
        f.stop()


def test_an_afternotok_chain_stops_after_its_first_success(fleet: Fleet) -> None:
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    r1 = fleet.submit(
        {"name": "r1", "command": [sys.executable, "-c", "raise SystemExit(1)", marker]}
    )
    chain = [r1]
    for i in range(2, 7):  # R2..R6, each afternotok on the one before
        chain.append(
            fleet.submit(
                {
                    "name": f"r{i}",
                    "command": [sys.executable, "-c", "pass", marker],
                    "depends_on": f"afternotok:{chain[-1]}",
                }
            )
        )
    # a job cancelled before it ever ran: its afternotok dependant must not run
    held = fleet.submit({"name": "held", "command": ["true"], "hold": True})
    after_held = fleet.submit(
        {"name": "after-held", "command": ["true"], "depends_on": f"afternotok:{held}"}
    )
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{held}").status_code == 202

    ends = [fleet.wait_status(j, TERMINAL, 30) for j in chain]
    got = [j["status"] for j in ends]
    assert got == ["FAILED", "SUCCEEDED"] + ["DEPENDENCY_FAILED"] * 4, got
    assert all(j["attempts"] == [] for j in ends[2:])
    assert chain[1] in ends[2]["failure_reason"] and "SUCCEEDED" in ends[2]["failure_reason"]

    got_after = fleet.wait_status(after_held, TERMINAL, 30)
    assert got_after["status"] == "DEPENDENCY_FAILED", got_after
    assert got_after["attempts"] == []
    assert "before it ever ran" in got_after["failure_reason"]
    assert fleet.check() == []
