"""A deposed leader's late AssignJob never starts the fenced attempt's code (issue 24, item 1).

Real processes: two ``gpufleet controller`` on PostgreSQL, ``gpufleet agent`` with mutual
TLS. The leader c0 holds every AssignJob it sends (``GPUFLEET_FAULT_RPC=assign_hold_ms``, a
message delayed in the network); node a1 reaches the controllers only through a TCP gate.
The job is placed on a1; a1 freezes (SIGSTOP), c0 freezes with its AssignJob (epoch 1) in
hand, a1's path to the control plane is cut. The standby c1 takes the lease (epoch 2), fences
a1's attempt after the fence timeout and runs the retry on a2. Then a1 and c0 resume: c0's
AssignJob reaches a1 before a1 could hear of epoch 2. The bar: exactly one attempt of the
job ever ran user code (each start appends its run id to a file).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import database_url_for
from tests.e2e.liveness_harness import Plane, TcpGate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TIMINGS = {
    "GPUFLEET_HEARTBEAT_INTERVAL_S": "1",
    "GPUFLEET_SUSPECT_AFTER_MISSED": "2",
    "GPUFLEET_FENCE_TIMEOUT_S": "3",
    "GPUFLEET_CONFIRM_TIMEOUT_S": "5",
    "GPUFLEET_SCHEDULER_TICK_S": "0.3",
    "GPUFLEET_LEADER_LEASE_S": "2",
    "GPUFLEET_DEFAULT_GRACE_S": "1",
    "GPUFLEET_AGENT_DISK_RESERVE_MB": "2",
}


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres)])
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    p = Plane(tmp_path, database_url_for(request), controllers=2, timings=TIMINGS)
    try:
        yield p
    finally:
        p.stop()


def test_a_deposed_leaders_late_assign_job_does_not_start_the_fenced_attempt(
    plane: Plane,
) -> None:
    p = plane
    c0, c1 = p.controllers
    c0.env = dict(c0.env, GPUFLEET_FAULT_RPC="assign_hold_ms=2000")
    c0.start()
    p.wait_for(lambda: p.leader() == 0, 60, "c0 to lead")
    c1.start()
    gate = TcpGate(p.addresses[1][0])  # a1 -> c1 (any replica serves agents)
    try:
        # the 4-GPU job fits a1 best (4 GPUs); a2 (8 GPUs) takes the retry
        p.start_agent("a1", gpus="4xH100-80GB", via=(gate.address, p.addresses[1][1]), wait=False)
        p.start_agent("a2", gpus="8xH100-80GB", order=[1], wait=False)
        for node in ("a1", "a2"):
            p.wait_for(lambda n=node: p.node_status(n) == "HEALTHY", 60, f"agent {node}")
        job_id = p.submit(3600, gpus=4)
        p.wait_for(lambda: "holding AssignJob" in _log(p, "c0"), 20, "c0 to hold its AssignJob")
        first = p.job(job_id)["attempts"][0]
        assert first[2] == "a1", first
        p.agents["a1"].send(signal.SIGSTOP)
        c0.send(signal.SIGSTOP)  # its AssignJob of epoch 1 stays in flight
        gate.cut()
        p.wait_for(lambda: p.leader() == 1, 30, "c1 to lead")
        p.wait_for(
            lambda: (
                len(p.job(job_id)["attempts"]) == 2
                and p.job(job_id)["attempts"][1][0] in {r for r, _ in p.started()}
            ),
            60,
            "the retry started on a2",
        )
        attempts = p.job(job_id)["attempts"]
        assert attempts[0] == (first[0], "FENCED", "a1"), attempts
        retry = attempts[1][0]
        assert attempts[1][2] == "a2", attempts
        # a1 wakes first (its server takes the connection), then the deposed leader, whose
        # held AssignJob goes out at once: a1 has not heard of epoch 2
        p.agents["a1"].send(signal.SIGCONT)
        time.sleep(0.3)
        c0.send(signal.SIGCONT)
        p.wait_for(
            lambda: (
                "refused for now" in _log(p, "agent-a1") or first[0] in {r for r, _ in p.started()}
            ),
            10,
            "a1 to answer the late AssignJob",
        )
        gate.restore()
        p.wait_for(lambda: p.node_status("a1") == "HEALTHY", 30, "a1 heard again")
        time.sleep(1.0)
        ran = [run_id for run_id, _ in p.started()]
        assert ran == [retry], f"user code of {ran} ran; only the retry {retry} may"
        assert p.job(job_id)["status"] == "RUNNING"
    finally:
        gate.close()


def _log(p: Plane, name: str) -> str:
    path = p.tmp / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""
