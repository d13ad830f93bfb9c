"""An array's ``%N`` while a node is lost (issue 24, item 9), with real processes: the agent
of the node running both tasks of a ``%2`` array is killed -9 (its shims and the tasks' own
processes run on, as on a partition). After the fence the two tasks are PENDING again and
their GPUs QUARANTINED; the throttle counts the fenced attempts (they hold GPUs) so no other
task starts on the healthy node, and at no moment do more than 2 task processes live."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from gpufleet.agent.procfs import read_stat
from tests.e2e.harness import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)]

# argv: [-c, marker, dir]: a task leaves its array index and pid in dir, then runs on
TASK = r"""
import os, sys, time
name = f"task-{os.environ['GPUFLEET_ARRAY_INDEX']}-{os.getpid()}"
open(os.path.join(sys.argv[2], name), "w").close()
time.sleep(600)
"""


def alive(pid: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.state not in "ZX"


def status_of(fleet: Fleet, node_id: str) -> str | None:
    return next(
        (n["status"] for n in fleet.get("/v1/nodes")["items"] if n["node_id"] == node_id), None
    )


def live_tasks(where: Path) -> list[str]:
    return sorted(p.name for p in where.iterdir() if alive(int(p.name.rsplit("-", 1)[1])))


@pytest.mark.fleet_settings(fence_timeout_s=4.0, suspect_after_missed=2)
def test_a_throttled_array_counts_its_fenced_tasks_until_their_quarantine_clears(
    fleet: Fleet,
) -> None:
    # a1 is the best fit for both 1-GPU tasks (2 GPUs free against a2's 4); started
    # together, then waited for
    fleet.start_agent("a1", gpus="2xH100-80GB", wait=False)
    fleet.start_agent("a2", gpus="4xH100-80GB")
    fleet.wait_for(lambda: status_of(fleet, "a1") == "HEALTHY", 30, "a1")
    where = fleet.tmp / "tasks"
    where.mkdir()
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    with fleet.http() as c:
        r = c.post(
            "/v1/jobs",
            json={"command": [sys.executable, "-c", TASK, marker, str(where)], "array": "0-3%2"},
            headers={"Idempotency-Key": os.urandom(8).hex()},
        )
        assert r.status_code == 201, r.text
    tasks = r.json()["job_ids"]
    for t in tasks[:2]:
        assert fleet.wait_status(t, {"RUNNING"}, timeout_s=20)["attempts"][0]["node_id"] == "a1"
    fleet.wait_for(lambda: len(live_tasks(where)) == 2, 10, "both tasks' processes")

    most: list[tuple[int, list[str]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            now = live_tasks(where)
            if not most or len(now) > most[0][0]:
                most[:] = [(len(now), now)]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fleet.kill_agent("a1")  # -9: the tasks' processes live on
        fleet.wait_for(lambda: status_of(fleet, "a1") == "QUARANTINED", 20, "the fence")
        time.sleep(2)  # several passes with 4 free GPUs on a2 and 4 tasks PENDING
        assert len(live_tasks(where)) == 2, live_tasks(where)
        first = fleet.job(tasks[0])
        assert first["status"] == "PENDING" and first["attempts"][0]["status"] == "FENCED"
        assert all(fleet.job(t)["status"] == "PENDING" for t in tasks)
        reason = fleet.job(tasks[0])["pending_reason"] or {}
        assert reason.get("code") == "array_throttled", reason
        assert reason["details"] == {
            "array_id": r.json()["array_id"],
            "running": 2,
            "max_running": 2,
            "quarantined": 2,
        }
        assert "QUARANTINED" in reason["message"]
        # the agent comes back (same state dir): it stops the fenced attempts, the quarantine
        # clears, and the array goes on, 2 at a time
        fleet.start_agent("a1", gpus="2xH100-80GB", wait=False)
        fleet.wait_for(lambda: status_of(fleet, "a1") == "HEALTHY", 30, "a1 back")
        fleet.wait_for(lambda: len(live_tasks(where)) == 2, 20, "two tasks running again")
    finally:
        done.set()
        sampler.join(timeout=5)
    assert most[0][0] <= 2, f"{most[0][0]} task processes alive at once: {most[0][1]}"
    assert fleet.check() == []
