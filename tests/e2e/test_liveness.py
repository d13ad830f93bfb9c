"""A stopped control plane or a leader failover fences no live node (docs/design/lifecycle.md,
"Silence is counted only while a controller listens"), a new leader places nothing on a node
it has not heard from, agents fail over between the controllers they are given.

Real processes throughout: ``gpufleet controller`` subprocesses (killed with SIGKILL, never
given the chance to release the lease), ``gpufleet agent`` subprocesses with mutual TLS and a
list of controllers, jobs that record each start. Short timings (heartbeat 1 s, fence 4 s)
except one test with the production defaults' proportions (scaled by
``GPUFLEET_TEST_PRODUCTION_SCALE``, 0.2 unless set; ``=1``: the defaults themselves).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpufleet.settings import Settings
from tests.e2e.conftest import database_url_for
from tests.e2e.liveness_harness import Plane
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HEARTBEAT_S = 1.0
FENCE_S = 4.0
SHORT = {
    "GPUFLEET_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
    "GPUFLEET_SUSPECT_AFTER_MISSED": "3",
    "GPUFLEET_FENCE_TIMEOUT_S": str(FENCE_S),
    "GPUFLEET_CONFIRM_TIMEOUT_S": "5",
    "GPUFLEET_SCHEDULER_TICK_S": "0.3",
    "GPUFLEET_LEADER_LEASE_S": "3",
    "GPUFLEET_DEFAULT_GRACE_S": "1",
    "GPUFLEET_AGENT_DISK_RESERVE_MB": "2",
}
PRODUCTION_SCALE = float(os.environ.get("GPUFLEET_TEST_PRODUCTION_SCALE", "0.2"))
"""The production-timings test runs the Settings defaults times this (1: as they are)."""
NOTHING_FENCED = {"fence_events": 0, "fenced_runs": 0, "nodes_not_healthy": 0}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> str | None:
    return database_url_for(request)


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres)])
def pg_database_url(request: pytest.FixtureRequest) -> str | None:
    """Two controllers contend for the lease: PostgreSQL, the production database."""
    return database_url_for(request)


@contextmanager
def plane(tmp: Path, url: str | None, controllers: int, **timings: str) -> Iterator[Plane]:
    p = Plane(tmp, url, controllers=controllers, timings=SHORT | timings)
    try:
        yield p
    finally:
        p.stop()


def _starts_per_run(p: Plane) -> Counter[str]:
    return Counter(run_id for run_id, _ in p.started())


def _assert_ran_once(p: Plane, jobs: list[str]) -> None:
    """Every job has exactly one attempt, and that attempt's process started once."""
    starts = _starts_per_run(p)
    for job_id in jobs:
        attempts = p.job(job_id)["attempts"]
        assert len(attempts) == 1, (job_id, attempts)
        assert starts[attempts[0][0]] == 1, (job_id, starts)
    assert sum(starts.values()) == len(jobs), starts


def _stopped_control_plane(p: Plane, stop_s: float, *, restart_agent: bool) -> None:
    """Two agents, two long jobs and one that ends while every controller is down (its
    agent also killed and restarted meanwhile when ``restart_agent``); the control plane is
    killed for ``stop_s`` and started again. Nothing is fenced, nothing runs twice, the job
    that ended meanwhile SUCCEEDED with its one attempt."""
    p.start_controllers()
    p.start_agent("a1")
    p.start_agent("a2")
    long_jobs = [p.submit(3600), p.submit(3600)]
    # it ends a little after the stop began: its end is heard only after the restart
    short_s = 5.0 + stop_s / 4
    short = p.submit(short_s)
    for job_id in [*long_jobs, short]:
        p.wait_status(job_id, {"RUNNING"}, 60)
    short_run = p.job(short)["attempts"][0]
    p.wait_for(lambda: short_run[0] in _starts_per_run(p), 30, "the short job's process")
    started = time.monotonic()
    for c in p.controllers:
        c.stop(signal.SIGKILL)
    stopped = time.monotonic()
    if restart_agent:  # the short job's agent dies too, and comes back before the controllers
        agent = p.agents[short_run[2]]
        agent.stop(signal.SIGKILL)
        time.sleep(1.0)
        agent.start()
    time.sleep(max(0.0, stop_s - (time.monotonic() - stopped)))
    assert time.monotonic() - started > short_s + 1, "the short job ended during the stop"
    for c in p.controllers:
        c.start()
    p.wait_for(lambda: p.leader() is not None, 60, "a leader after the restart")
    restarted = time.monotonic()
    p.wait_status(short, {"SUCCEEDED", "FAILED", "PENDING"}, 60)
    # a leader that counted the stop as silence fences at its first pass; give this one
    # the whole fence timeout + heartbeat interval + margin of its own
    fence_s = float(p.env["GPUFLEET_FENCE_TIMEOUT_S"])
    heartbeat_s = float(p.env["GPUFLEET_HEARTBEAT_INTERVAL_S"])
    time.sleep(max(0.0, fence_s + 2 * heartbeat_s + 3 - (time.monotonic() - restarted)))
    assert p.fenced() == NOTHING_FENCED
    assert p.job(short) == {
        "status": "SUCCEEDED",
        "attempts": [(short_run[0], "SUCCEEDED", short_run[2])],
    }
    for job_id in long_jobs:
        assert p.job(job_id)["status"] == "RUNNING"
    _assert_ran_once(p, [*long_jobs, short])
    assert p.check() == []


def test_a_stopped_control_plane_fences_no_live_node(
    tmp_path: Path, database_url: str | None
) -> None:
    """The only controller is killed for 2.5x the fence timeout (10 s, fence 4 s) with jobs
    running; one job exits 0 while it is down and its agent is killed and restarted meanwhile.
    After the restart: 0 nodes fenced, 0 jobs run again, the job that ended meanwhile
    SUCCEEDED with one attempt (its completion, reported late, is the current attempt's)."""
    with plane(tmp_path, database_url, 1) as p:
        _stopped_control_plane(p, 2.5 * FENCE_S, restart_agent=True)


def _production_timings(scale: float) -> dict[str, str]:
    """The Settings defaults of every interval the liveness rules use (heartbeat, fence,
    confirm, scheduler tick, leader lease), each times ``scale``, so every ratio between them
    is the production one; the suspect count (missed heartbeats) is a count, kept as is."""
    fields = Settings.model_fields
    names = {
        "GPUFLEET_HEARTBEAT_INTERVAL_S": "heartbeat_interval_s",
        "GPUFLEET_FENCE_TIMEOUT_S": "fence_timeout_s",
        "GPUFLEET_CONFIRM_TIMEOUT_S": "confirm_timeout_s",
        "GPUFLEET_SCHEDULER_TICK_S": "scheduler_tick_s",
        "GPUFLEET_LEADER_LEASE_S": "leader_lease_s",
    }
    timings = {env: str(float(fields[name].default) * scale) for env, name in names.items()}
    return timings | {"GPUFLEET_SUSPECT_AFTER_MISSED": str(fields["suspect_after_missed"].default)}


@pytest.mark.timeout(900)
def test_production_timings_a_control_plane_stopped_for_twice_the_fence_timeout(
    tmp_path: Path,
) -> None:
    """The production defaults' proportions (heartbeat 10 s, suspect after 3 missed, fence
    60 s, confirm 30 s, lease 15 s, tick 1 s), scaled by ``GPUFLEET_TEST_PRODUCTION_SCALE``
    (0.2 unless set: heartbeat 2 s, fence 12 s; ``GPUFLEET_TEST_PRODUCTION_SCALE=1`` runs the
    defaults themselves, ~4 minutes): the control plane is killed for twice the fence timeout
    with jobs running and one ending during the stop. 0 nodes fenced, 0 jobs re-run, the job
    that ended SUCCEEDED with one attempt. (~1 minute at 0.2.)"""
    timings = _production_timings(PRODUCTION_SCALE)
    with plane(tmp_path, None, 1, **timings) as p:
        _stopped_control_plane(
            p, 2 * float(timings["GPUFLEET_FENCE_TIMEOUT_S"]), restart_agent=False
        )


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_leader_lost_with_jobs_running_fences_nothing_and_agents_fail_over(
    tmp_path: Path, pg_database_url: str | None, how: str
) -> None:
    """Two controllers; a1 is given the leader first, a2 the standby first. The leader is
    killed with SIGKILL (its connections are reset) or frozen with SIGSTOP (its connections
    stay open and nothing answers, as when its host vanishes) while jobs run: a1 fails over
    to the standby, which takes the lease. 0 nodes fenced, 0 jobs re-run, and both agents
    take new work from the new leader (the new jobs fit only one per node)."""
    with plane(tmp_path, pg_database_url, 2) as p:
        p.start_controllers()
        lead = p.leader()
        assert lead is not None
        other = 1 - lead
        p.start_agent("a1", order=[lead, other])
        a2_address = f"127.0.0.1:{free_port()}"  # the address the controllers dial
        p.start_agent("a2", order=[other, lead], args=("--advertise-address", a2_address))
        assert p.node_address("a2") == a2_address
        running = [p.submit(3600, gpus=6), p.submit(3600, gpus=6)]  # one per node
        for job_id in running:
            p.wait_status(job_id, {"RUNNING"}, 60)
        assert {p.job(j)["attempts"][0][2] for j in running} == {"a1", "a2"}
        epoch = p.lease_epoch()
        if how == "kill":
            p.controllers[lead].stop(signal.SIGKILL)
        else:
            p.controllers[lead].send(signal.SIGSTOP)
        p.wait_for(lambda: p.leader() == other, 30, "the standby to lead")
        took_over = time.monotonic()
        assert p.lease_epoch() == epoch + 1
        new = [p.submit(1.0, gpus=2), p.submit(1.0, gpus=2)]  # 2 GPUs free per node
        for job_id in new:
            p.wait_status(job_id, {"SUCCEEDED", "FAILED"}, 60)
        assert {p.job(j)["attempts"][0][2] for j in new} == {"a1", "a2"}
        time.sleep(max(0.0, FENCE_S + 2 * HEARTBEAT_S + 3 - (time.monotonic() - took_over)))
        assert p.fenced() == NOTHING_FENCED
        for job_id in new:
            assert p.job(job_id)["status"] == "SUCCEEDED"
        for job_id in running:
            assert p.job(job_id)["status"] == "RUNNING"
        _assert_ran_once(p, [*running, *new])
        if how == "freeze":  # the old leader wakes up deposed: its writes are refused
            p.controllers[lead].send(signal.SIGCONT)
            time.sleep(2 * HEARTBEAT_S + 1)
            assert p.leader() == other
            assert p.fenced() == NOTHING_FENCED


def test_a_job_submitted_during_a_failover_goes_to_a_node_the_new_leader_heard(
    tmp_path: Path, pg_database_url: str | None
) -> None:
    """a2 (4 GPUs: the best fit of a 2-GPU job) freezes (SIGSTOP) as the leader is killed;
    a job is submitted during the failover. The new leader's first passes see a2 HEALTHY
    (silent for less than the suspect window), but a2 has not been heard since it took
    over: the job runs on a1, once. a2, really silent, is still fenced at fence timeout +
    one heartbeat interval after the takeover (a dead node is fenced while a leader lives)."""
    timings = {"GPUFLEET_SUSPECT_AFTER_MISSED": "6", "GPUFLEET_FENCE_TIMEOUT_S": "8"}
    with plane(tmp_path, pg_database_url, 2, **timings) as p:
        p.start_controllers()
        lead = p.leader()
        assert lead is not None
        p.start_agent("a1", gpus="8xH100-80GB")
        p.start_agent("a2", gpus="4xH100-80GB")
        p.agents["a2"].send(signal.SIGSTOP)
        p.controllers[lead].stop(signal.SIGKILL)
        job_id = p.submit(1.0, gpus=2)
        p.wait_for(lambda: p.leader() == 1 - lead, 60, "the standby to lead")
        took_over = time.monotonic()
        p.wait_status(job_id, {"SUCCEEDED", "FAILED"}, 60)
        got = p.job(job_id)
        assert got["status"] == "SUCCEEDED", got
        assert [node for _, _, node in got["attempts"]] == ["a1"], got
        _assert_ran_once(p, [job_id])
        p.wait_for(lambda: p.node_status("a2") == "QUARANTINED", 60, "a2 fenced")
        fenced_after = time.monotonic() - took_over
        assert fenced_after >= 8 + HEARTBEAT_S - 1, fenced_after  # not before its bound
        assert p.node_status("a1") == "HEALTHY"
        p.agents["a2"].send(signal.SIGCONT)
        p.wait_for(lambda: p.node_status("a2") == "HEALTHY", 60, "a2 back")


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed")
def test_agents_behind_haproxy_survive_a_leader_kill(
    tmp_path: Path, pg_database_url: str | None
) -> None:
    """The load-balancer alternative: agents given one haproxy address (``balance first``,
    health checks every second, ``on-marked-down shutdown-sessions``) in front of two
    controllers; the controller haproxy sends to is the leader and is killed with SIGKILL
    while jobs run. haproxy cuts the agents' connections, they reconnect through it to the
    other controller: 0 nodes fenced, 0 jobs re-run, new work runs on both nodes."""
    with plane(tmp_path, pg_database_url, 2) as p:
        p.controllers[0].start()  # c0 leads: haproxy's first server
        p.wait_for(lambda: p.leader() == 0, 60, "c0 to lead")
        p.controllers[1].start()
        via = p.start_haproxy()
        p.start_agent("a1", via=via)
        p.start_agent("a2", via=via)
        running = [p.submit(3600, gpus=6), p.submit(3600, gpus=6)]
        for job_id in running:
            p.wait_status(job_id, {"RUNNING"}, 60)
        p.controllers[0].stop(signal.SIGKILL)
        p.wait_for(lambda: p.leader() == 1, 30, "c1 to lead")
        took_over = time.monotonic()
        new = [p.submit(1.0, gpus=2), p.submit(1.0, gpus=2)]
        for job_id in new:
            p.wait_status(job_id, {"SUCCEEDED", "FAILED"}, 60)
        assert {p.job(j)["attempts"][0][2] for j in new} == {"a1", "a2"}
        time.sleep(max(0.0, FENCE_S + 2 * HEARTBEAT_S + 3 - (time.monotonic() - took_over)))
        assert p.fenced() == NOTHING_FENCED
        for job_id in running:
            assert p.job(job_id)["status"] == "RUNNING"
        _assert_ran_once(p, [*running, *new])
