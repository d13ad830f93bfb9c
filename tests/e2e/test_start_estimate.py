""" "When will my job start?" on a real platform (controller, API, a real agent, real job
processes): a job waiting behind one with a time limit gets a range that contains its real
start; behind one with no limit and no history, "unknown because ..." naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from typing import Any

import pytest

from tests.e2e.harness import Fleet

pytestmark = pytest.mark.slow


def _why(fleet: Fleet, job_id: str) -> str:
    env = dict(
        os.environ,
        GPUFLEET_URL=fleet.api.url,
        GPUFLEET_TOKEN=fleet.tokens["vision"],
        GPUFLEET_CONFIG=str(fleet.tmp / "none.yaml"),
    )
    out = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "why", job_id],
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def _estimate(fleet: Fleet, job_id: str) -> dict[str, Any]:
    """The job's start estimate once the leader computed one (it does every ~10 s)."""
    found: dict[str, Any] = {}

    def ready() -> bool:
        reason = fleet.job(job_id).get("pending_reason") or {}
        est = reason.get("start_estimate") or {}
        if est.get("text") and "not estimated it yet" not in est["text"]:
            found.update(est)
            return True
        return False

    fleet.wait_for(ready, 30, f"a start estimate for {job_id}")
    return found


def _t(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _job(cmd: str, **extra: Any) -> dict[str, Any]:
    return {"command": ["sh", "-c", cmd], "gpu_count": 1, **extra}


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_why_shows_a_range_with_a_limit_and_unknown_without(fleet: Fleet) -> None:
    fleet.start_agent("a1", gpus="1xH100-80GB", wait=False)
    fleet.wait_for(
        lambda: any(n["status"] == "HEALTHY" for n in fleet.get("/v1/nodes")["items"]),
        120,  # a busy shared machine starts an agent slowly
        "agent a1",
    )

    # running work with no max_runtime_s and no history: the wait is unbounded
    forever = fleet.submit(_job("sleep 300", name="forever"))
    fleet.wait_status(forever, "RUNNING", 30)
    behind = fleet.submit(_job("true", name="behind"))
    est = _estimate(fleet, behind)
    assert est["unknown"] and forever in est["unknown"] and "max_runtime_s" in est["unknown"]
    why = _why(fleet, behind)
    assert "start:           unknown because" in why and forever in why
    fleet.http().delete(f"/v1/jobs/{forever}").raise_for_status()
    fleet.wait_status(behind, "SUCCEEDED", 60)

    # running work bounded by a time limit: a range, and the real start falls inside it
    limited = fleet.submit(_job("sleep 25", name="limited", max_runtime_s=45))
    fleet.wait_status(limited, "RUNNING", 30)
    waiting = fleet.submit(_job("true", name="waiting"))
    est = _estimate(fleet, waiting)
    assert est["unknown"] is None, est
    assert "time limits" in est["basis"] and est["ahead"] == 0
    why = _why(fleet, waiting)
    assert "start:           " in why and "running work bounded by time limits" in why
    line = next(x for x in why.splitlines() if x.strip().startswith("start:"))
    assert "within" in line or "in " in line, line
    fleet.wait_status(waiting, "SUCCEEDED", 60)
    started = fleet.job(waiting)["scheduled_at"]
    lo, hi, real = _t(est["earliest_at"]), _t(est["latest_at"]), _t(started)
    assert lo - 1.0 <= real <= hi + 1.0, (est, started)  # 1 s: a scheduler tick and a bit
    assert hi - _t(fleet.job(limited)["started_at"]) <= 46.0  # bounded by the 45 s limit
