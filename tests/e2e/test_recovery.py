"""Nothing stays stuck (issue 7): undelivered work, deposed leaders, dead nodes, bad nodes.

Real agents (subprocesses, frozen with SIGSTOP or killed with SIGKILL), real job processes,
both databases. Waits are on conditions with generous deadlines; the bounds the issue states
(confirm timeout + grace, fence timeout + one pass) are asserted on measured elapsed times.
"""

from __future__ import annotations

import signal
import sys
import time
from datetime import datetime
from typing import Any

import pytest

from gpufleet.controller.agents import RPC_TIMEOUT_S
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow

CONFIRM_TIMEOUT_S = 5.0
GRACE_S = 2.0
fleet_settings: dict[str, Any] = {"confirm_timeout_s": CONFIRM_TIMEOUT_S}


def py(code: str, marker: str) -> list[str]:
    return [sys.executable, "-c", code, marker]


def marker_of(fleet: Fleet) -> str:
    return f"gpufleet-test-marker-{fleet.tmp.name}"


def _estimate_in_past(job: dict[str, Any]) -> str | None:
    """The job's promised start time if it is already in the past, else None."""
    at = (job.get("pending_reason") or {}).get("estimated_start_at")
    if at and datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp() < time.time() - 1:
        return str(at)
    return None


def test_cancel_of_an_undelivered_attempt_ends_and_releases(fleet: Fleet) -> None:
    """Issue 7, failure 1: freeze the agent, submit an 8-GPU job, wait past the AssignJob
    deadline, cancel, resume the agent: the job ends CANCELLED and the 8 GPUs come back within
    confirm timeout + grace; the next job's ``why`` never promises a start in the past."""
    fleet.start_agent("a1")
    marker = marker_of(fleet)
    fleet.signal_agent("a1", signal.SIGSTOP)
    stuck = fleet.submit({"command": py("import time; time.sleep(600)", marker), "gpu_count": 8})
    fleet.wait_status(stuck, {"SCHEDULED"})
    time.sleep(RPC_TIMEOUT_S + 1.5)  # the AssignJob has timed out at the controller
    nxt = fleet.submit({"command": py("print('next')", marker), "gpu_count": 8})
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{stuck}").status_code == 202
    past: list[str] = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # the StopRun cannot reach the frozen agent
        past += [p for p in [_estimate_in_past(fleet.job(nxt))] if p]
        time.sleep(0.2)
    assert fleet.job(stuck)["status"] == "SCHEDULED"
    resumed = time.monotonic()
    fleet.signal_agent("a1", signal.SIGCONT)

    def released() -> bool:
        nonlocal past
        past += [p for p in [_estimate_in_past(fleet.job(nxt))] if p]
        return fleet.job(stuck)["status"] in TERMINAL

    fleet.wait_for(released, 60, "the cancelled job to end")
    elapsed = time.monotonic() - resumed
    got = fleet.job(stuck)
    assert got["status"] == "CANCELLED", got
    assert [a["status"] for a in got["attempts"]] == ["CANCELLED"]
    assert elapsed <= CONFIRM_TIMEOUT_S + GRACE_S, f"released {elapsed:.1f} s after resume"
    done = fleet.wait_status(nxt, TERMINAL, timeout_s=60)
    assert done["status"] == "SUCCEEDED", done
    assert past == [], f"why promised start times already past: {past}"
    assert fleet.check() == []
    assert fleet.node("a1")["available_gpus"] == 8
