"""Faults at fleet scale, CI-sized (issue 25): two ``gpufleet controller`` processes (leader +
standby) on PostgreSQL, NODES hollow nodes (the agent's own code, mutual TLS, each joined
with its own token, given both controllers; docs/design/hollow-nodes.md), JOBS short jobs;
while they run, SILENCE nodes running attempts are cut off and the leader is killed with
SIGKILL a moment later, so the standby must take over and do the fencing.

Correctness only, never a timing: every job SUCCEEDED with exactly one successful attempt,
its other attempts only FENCED on a silenced node; no invariant violation at any sample of
the checker (a GPU in two reservations among them); the silenced nodes fenced
(QUARANTINED); no other node ever SUSPECT or fenced (node transition events)."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.domain.types import JobSpec, Resources
from gpufleet.services.jobs import submit_job
from gpufleet.store.tables import JobRunRow
from tests.e2e import hollow_fleet
from tests.e2e.conftest import database_url_for
from tests.e2e.liveness_harness import TEAM, Plane

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(400)]

NODES = 100
JOBS = 1000
SILENCE = 5
TIMINGS = {
    # 100 nodes share one process (and its GIL) with two controllers and PostgreSQL on a
    # 2-core machine: a beat every 2 s, SUSPECT after 5 missed, fenced after 16 s
    "GPUFLEET_HEARTBEAT_INTERVAL_S": "2",
    "GPUFLEET_SUSPECT_AFTER_MISSED": "5",
    "GPUFLEET_FENCE_TIMEOUT_S": "16",
    "GPUFLEET_CONFIRM_TIMEOUT_S": "10",
    "GPUFLEET_SCHEDULER_TICK_S": "0.3",
    "GPUFLEET_LEADER_LEASE_S": "4",
    "GPUFLEET_DEFAULT_GRACE_S": "1",
    "GPUFLEET_AGENT_DISK_RESERVE_MB": "0",
}


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres)])
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    p = Plane(tmp_path, database_url_for(request), controllers=2, timings=TIMINGS)
    try:
        yield p
    finally:
        p.stop()


def submit_hollow(p: Plane, i: int, run_s: int = 2) -> str:
    spec = JobSpec(
        command=("hollow",),
        resources=Resources(1 + i % 4, ()),
        name=f"f-{i}",
        env={"HOLLOW_RUN_S": str(run_s), "HOLLOW_ARTIFACT_BYTES": str(64 * (i % 3))},
    )
    return submit_job(p.db, team_id=TEAM, idempotency_key=str(uuid.uuid4()), spec=spec).job_id


def test_leader_kill_and_silenced_nodes_at_scale_run_every_job_once(plane: Plane) -> None:
    p = plane
    control = p.tmp / "silenced.txt"
    control.write_text("")
    p.start_controllers()
    hollow = hollow_fleet.start_hollow(
        p.db,
        p.settings,
        p.tmp,
        NODES,
        control,
        controllers=",".join(a for a, _ in p.addresses),
        join_addresses=",".join(j for _, j in p.addresses),
    )
    violations: list[str] = []
    samples = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            violations.extend(p.check())
            samples[0] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        p.wait_for(lambda: hollow_fleet.healthy_count(p.db) == NODES, 90, "hollow nodes HEALTHY")
        sampler.start()
        jobs = [submit_hollow(p, i) for i in range(JOBS // 2)]
        silenced: list[str] = []

        def busy() -> bool:
            silenced[:] = hollow_fleet.busy_nodes(p.db, SILENCE)
            return len(silenced) == SILENCE

        p.wait_for(busy, 60, f"{SILENCE} nodes running attempts")
        control.write_text("\n".join(silenced) + "\n")
        time.sleep(1.0)  # the hollow process reads its control file every 0.5 s
        # the second half asks for more GPU-seconds than the fleet has free (~1,250 GPUs for
        # 6 s on 800), so a backlog is waiting at the kill however fast the first half ran
        jobs += [submit_hollow(p, i, run_s=6) for i in range(JOBS // 2, JOBS)]
        # a loaded machine can let the 4 s lease lapse between renewals: wait for a holder
        p.wait_for(lambda: p.leader() is not None, 30, "a leader to kill")
        leader = p.leader()
        assert leader is not None
        epoch = p.lease_epoch()
        assert hollow_fleet.job_statuses(p.db, jobs)["PENDING"] > 0, "no backlog at the kill"
        p.controllers[leader].stop(signal.SIGKILL)
        p.wait_for(lambda: p.lease_epoch() > epoch and p.leader() is not None, 60, "takeover")
        p.controllers[leader].start()  # back, as the standby

        def ended() -> bool:
            counts = hollow_fleet.job_statuses(p.db, jobs)
            return counts["SUCCEEDED"] == JOBS or counts["FAILED"] + counts["CANCELLED"] > 0

        p.wait_for(ended, 240, "every job to end")
        p.wait_for(
            lambda: all(hollow_fleet.node_statuses(p.db)[n] == "QUARANTINED" for n in silenced),
            60,
            "the silenced nodes fenced",
        )
        time.sleep(1.5)  # one more sample of the checker after the last completions
        nodes = hollow_fleet.node_statuses(p.db)  # before the hollow nodes stop
    finally:
        done.set()
        hollow_fleet.stop_hollow(hollow)

    def fenced_on_silenced(r: JobRunRow) -> bool:
        return r.status == "FENCED" and r.node_id in silenced

    hollow_fleet.assert_each_succeeded_once(p.db, jobs, fenced_on_silenced)
    assert hollow_fleet.ever_not_healthy(p.db) == set(silenced)
    assert {n: st for n, st in nodes.items() if n in silenced} == dict.fromkeys(
        silenced, "QUARANTINED"
    )
    assert samples[0] > 0
    assert violations == [], violations[:5]
    assert p.check() == []
