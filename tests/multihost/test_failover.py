"""Control-plane failures on a fleet spread over network-namespace hosts
(tests/multihost/fleet.py): every agent is given both controllers by address
(``--controller ctl-1:8421,ctl-2:8421``) and fails over between them. Each scenario runs a
long job on every node and checks, from the client host, that losing the leader (its process
or its whole host) or the whole control plane fences no live node and runs no job twice:
"fenced" is read from the nodes' states (polled all along) and the fleet's ``fence``
scheduling events, "re-run" from each job's attempts. The last scenario starts an agent on
another object store than the fleet's: it is refused at registration and never listed."""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.fleet import AGENT_PORT, GPUFLEET, MultiHostFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED", "DEPENDENCY_FAILED"}

# a 5 s leader lease (the default 15 s only adds waiting); fenced after 6 s of silence as in
# FAST_SETTINGS, so a takeover that counted the leaderless time as silence would fence
MULTIHOST_SETTINGS = {"GPUFLEET_LEADER_LEASE_S": "5"}

# runs until its release file exists (outside /tmp: a process job's /tmp is its own)
HOLD = r"""
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.2)
print("released", flush=True)
"""


@pytest.fixture(scope="module")
def release_dir() -> Iterator[Path]:
    path = Path("/run") / f"gfmh-release-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class NodeWatch:
    """Polls ``/v1/nodes`` from the client host every 0.5 s on a thread; ``unhealthy`` holds
    every ``(node_id, status)`` seen other than HEALTHY (a fence makes it QUARANTINED or
    FENCED; SUSPECT would show a leader counting silence)."""

    def __init__(self, fleet: MultiHostFleet) -> None:
        self.fleet = fleet
        self.unhealthy: set[tuple[str, str]] = set()
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                nodes = self.fleet.nodes()
            except Exception:  # an API call lost to load: the next poll sees the state
                nodes = {}
            for node_id, node in nodes.items():
                if node["status"] != "HEALTHY":
                    self.unhealthy.add((node_id, str(node["status"])))
            self.polls += bool(nodes)
            self._stop.wait(0.5)

    def __enter__(self) -> NodeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def _sql(fleet: MultiHostFleet, query: str, **params: Any) -> list[tuple[Any, ...]]:
    """A read of the fleet's PostgreSQL, from the client host."""

    def run() -> list[tuple[Any, ...]]:
        import sqlalchemy as sa

        engine = sa.create_engine(fleet.database_url(), poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(sa.text(query), params)]
        finally:
            engine.dispose()

    return fleet.net.call_in("client", run)


def _fence_events(fleet: MultiHostFleet) -> int:
    return int(_sql(fleet, "SELECT count(*) FROM scheduling_events WHERE kind = 'fence'")[0][0])


def _hold_one_job_per_node(fleet: MultiHostFleet, release: Path) -> dict[str, str]:
    """A 4-GPU job on each node (all of its GPUs), running: ``{node_id: job_id}``."""
    jobs = []
    for _ in fleet.gpu_hosts:
        path = release / uuid.uuid4().hex
        job_id = fleet.submit(
            {"command": [sys.executable, "-c", HOLD, str(path)], "gpu_count": 4, "name": "hold"}
        )
        RELEASE[job_id] = path
        jobs.append(job_id)
    by_node: dict[str, str] = {}
    for job_id in jobs:
        job = fleet.wait_status(job_id, {"RUNNING"}, timeout_s=90)
        by_node[job["attempts"][0]["node_id"]] = job_id
    assert sorted(by_node) == fleet.gpu_hosts, by_node
    return by_node


RELEASE: dict[str, Path] = {}  # job id -> the file that ends it


def _release(job_id: str) -> None:
    RELEASE[job_id].write_text("go")


def _heartbeats(fleet: MultiHostFleet) -> dict[str, str | None]:
    return {n: node["last_heartbeat_at"] for n, node in fleet.nodes().items()}


def _wait_heard_again(fleet: MultiHostFleet, since: dict[str, str | None], what: str) -> None:
    """Until every GPU node's last heartbeat is newer than in ``since``."""
    fleet.wait_for(
        lambda: all(
            (h := _heartbeats(fleet).get(n)) is not None and h != since.get(n)
            for n in fleet.gpu_hosts
        ),
        60,
        what,
    )


def _finish_and_count(
    fleet: MultiHostFleet, jobs: dict[str, str], watch: NodeWatch, fences_before: int
) -> None:
    """Release every job and check the outcome: each SUCCEEDED with exactly one attempt
    (nothing re-run), no fence event, no node seen other than HEALTHY."""
    for job_id in jobs.values():
        _release(job_id)
    for node_id, job_id in jobs.items():
        job = fleet.wait_status(job_id, TERMINAL, timeout_s=90)
        assert job["status"] == "SUCCEEDED", job
        assert [(a["attempt"], a["node_id"]) for a in job["attempts"]] == [(1, node_id)], job
    assert _fence_events(fleet) == fences_before, "a node was fenced"
    assert watch.polls > 0
    assert watch.unhealthy == set(), watch.unhealthy
    check = fleet.admin_check()
    assert check.returncode == 0, check.stdout + check.stderr


def _failovers(fleet: MultiHostFleet, lost: str) -> dict[str, int]:
    """Per GPU host: how many times its agent logged moving from controller process
    ``lost`` to the other one (``agent.controllers``' warning)."""
    frm, to = (f"{fleet.addr(_host(c))}:8421" for c in (lost, _other(lost)))
    line = f"controller {frm} not reachable: using {to}"
    return {
        h: (fleet.logs / f"agent-{h}.log").read_text(errors="replace").count(line)
        for h in fleet.gpu_hosts
    }


def _wait_failed_over(fleet: MultiHostFleet, lost: str, before: dict[str, int]) -> None:
    fleet.wait_for(
        lambda: all(n > before[h] for h, n in _failovers(fleet, lost).items()),
        60,
        f"every agent to move from {lost} to {_other(lost)}",
    )


def _host(controller: str) -> str:
    return "ctl-" + controller.rsplit("-", 1)[1]


def _other(controller: str) -> str:
    return "controller-2" if controller == "controller-1" else "controller-1"


def _wait_one_leader(fleet: MultiHostFleet, leader: str, timeout_s: float = 60) -> None:
    fleet.wait_for(lambda: fleet.leader() == leader, timeout_s, f"{leader} to lead")


def test_agents_are_given_both_controllers_by_address(mh_fleet: MultiHostFleet) -> None:
    fleet = mh_fleet
    ctl = f"{fleet.addr('ctl-1')}:8421,{fleet.addr('ctl-2')}:8421"
    for host in fleet.gpu_hosts:
        argv = fleet.procs[f"agent-{host}"].argv
        assert argv[argv.index("--controller") + 1] == ctl, argv
    nodes = fleet.nodes()
    assert {n: nodes[n]["address"] for n in fleet.gpu_hosts} == {
        h: f"{fleet.addr(h)}:{AGENT_PORT}" for h in fleet.gpu_hosts
    }


def test_leader_killed_with_a_job_on_every_node_fences_nothing_and_reruns_nothing(
    mh_fleet: MultiHostFleet, release_dir: Path
) -> None:
    """kill -9 of the leading controller: the other takes the lease, the agents fail over
    to it; past the fence timeout after the takeover no node is fenced, and every job ends
    SUCCEEDED on its first attempt."""
    fleet = mh_fleet
    fence_s = float(fleet.settings["GPUFLEET_FENCE_TIMEOUT_S"])
    fences = _fence_events(fleet)
    jobs = _hold_one_job_per_node(fleet, release_dir)
    leader = fleet.leader()
    assert leader is not None
    moved = _failovers(fleet, leader)
    with NodeWatch(fleet) as watch:
        fleet.kill_process(leader, signal.SIGKILL)
        _wait_one_leader(fleet, _other(leader))
        _wait_failed_over(fleet, leader, moved)  # the harness's agents were on the leader
        heard = _heartbeats(fleet)
        time.sleep(fence_s + 3)  # past the fence timeout under the new leader
        _wait_heard_again(fleet, heard, "every agent heard by the new leader's side")
        _finish_and_count(fleet, jobs, watch, fences)
    fleet.start_process(leader)  # back as the standby
    fleet.wait_for(lambda: _scrapes(fleet, leader), 60, f"{leader} up again", log=leader)
    assert fleet.leader() == _other(leader)


def _leader_metrics(fleet: MultiHostFleet) -> dict[str, float | None]:
    """Each controller's ``gpufleet_leader`` gauge (None: not answering)."""
    import httpx

    def get(host: str) -> float | None:
        try:
            text = httpx.get(f"http://{fleet.addr(host)}:9421/metrics", timeout=3).text
        except httpx.HTTPError:
            return None
        line = next((x for x in text.splitlines() if x.startswith("gpufleet_leader ")), "")
        return float(line.split()[1]) if line else None

    return {
        c: fleet.net.call_in("client", get, _host(c)) for c in ("controller-1", "controller-2")
    }


def _scrapes(fleet: MultiHostFleet, controller: str) -> bool:
    import httpx

    host = _host(controller)

    def get() -> bool:
        try:
            return httpx.get(f"http://{fleet.addr(host)}:9421/metrics", timeout=3).is_success
        except httpx.HTTPError:
            return False

    return fleet.net.call_in("client", get)


def test_leaders_host_cut_off_agents_fail_over_fencing_nothing(
    mh_fleet: MultiHostFleet, release_dir: Path
) -> None:
    """The leading controller's host loses its link (its process lives on, unreachable and
    cut from the database): the other controller takes the lease once it expires, the agents
    fail over to it, no node is fenced and no job re-run. The link comes back afterwards and
    the fleet has one leader."""
    fleet = mh_fleet
    fence_s = float(fleet.settings["GPUFLEET_FENCE_TIMEOUT_S"])
    fences = _fence_events(fleet)
    jobs = _hold_one_job_per_node(fleet, release_dir)
    leader = fleet.leader()
    assert leader is not None
    host = _host(leader)
    moved = _failovers(fleet, leader)
    with NodeWatch(fleet) as watch:
        fleet.cut(host)
        try:
            _wait_one_leader(fleet, _other(leader))
            _wait_failed_over(fleet, leader, moved)
            heard = _heartbeats(fleet)
            time.sleep(fence_s + 3)
            _wait_heard_again(fleet, heard, "every agent heard through the other controller")
            assert fleet.procs[leader].running, "the cut-off controller lives on"
            _finish_and_count(fleet, jobs, watch, fences)
        finally:
            fleet.restore(host)
    # back on the network: it stays (or becomes) the standby; one leader, the other one
    fleet.wait_for(lambda: _scrapes(fleet, leader), 60, f"{host} reachable again", log=leader)
    assert fleet.procs[leader].running
    want = {leader: 0.0, _other(leader): 1.0}
    fleet.wait_for(
        lambda: _leader_metrics(fleet) == want, 60, f"{leader} to say it no longer leads"
    )


def test_whole_control_plane_down_twice_the_fence_timeout_fences_nothing(
    mh_fleet: MultiHostFleet, release_dir: Path
) -> None:
    """Both controllers stopped for 2 x the fence timeout while a job runs on every node;
    one job ends during the outage. When they are back: no node fenced, no job re-run, the
    job that ended meanwhile SUCCEEDED on its one attempt."""
    fleet = mh_fleet
    fence_s = float(fleet.settings["GPUFLEET_FENCE_TIMEOUT_S"])
    fences = _fence_events(fleet)
    jobs = _hold_one_job_per_node(fleet, release_dir)
    early_node = fleet.gpu_hosts[0]
    early = jobs[early_node]
    with NodeWatch(fleet) as watch:
        for ctl in ("controller-1", "controller-2"):
            fleet.stop_process(ctl)
        down_at = time.monotonic()
        assert fleet.leader() is None
        _release(early)  # it ends while no controller hears of it
        time.sleep(max(0.0, 2 * fence_s - (time.monotonic() - down_at)))
        assert fleet.job(early)["status"] == "RUNNING"  # nobody recorded the end yet
        for ctl in ("controller-1", "controller-2"):
            fleet.start_process(ctl)
        fleet.wait_for(lambda: fleet.leader() is not None, 90, "a leader", log="controller-1")
        job = fleet.wait_status(early, TERMINAL, timeout_s=60)
        assert job["status"] == "SUCCEEDED", job
        assert [(a["attempt"], a["node_id"]) for a in job["attempts"]] == [(1, early_node)]
        heard = _heartbeats(fleet)
        time.sleep(fence_s + 3)
        _wait_heard_again(fleet, heard, "every agent heard after the outage")
        _finish_and_count(fleet, jobs, watch, fences)


def test_an_agent_on_another_object_store_is_refused(mh_fleet: MultiHostFleet) -> None:
    """An agent joined with a valid join token but set to another object store (a local
    directory, which its own write/read probe accepts) is refused by the controller at
    registration: it exits 5 naming both stores, is never listed, and no attempt is ever
    placed on it."""
    fleet = mh_fleet
    node_id, host = "gpu-other-store", "client"
    data = fleet.host_dir(host) / "other-agent"
    store = data / "store"
    store.mkdir(parents=True, exist_ok=True)
    env = fleet._env(
        data,
        GPUFLEET_JOIN_TOKEN=fleet.join_token(node_id),
        GPUFLEET_OBJECT_STORE_URL=f"file://{store}",
    )
    name = f"agent-{node_id}"
    fleet.add_process(
        name,
        host,
        [*GPUFLEET, "agent", "--node-id", node_id, "--gpus", fleet.gpus,
         "--controller", fleet.controllers, "--advertise-address", fleet.addr(host),
         "--port", str(AGENT_PORT + 1), "--state-dir", str(data / "agent"),
         "--jobs-dir", str(data / "jobs"), "--job-uids", "agent", "--runtime", "none"],
        env,
    )  # fmt: skip
    fleet.start_process(name)
    popen = fleet.procs[name].popen
    assert popen is not None
    seen: set[str] = set()

    def exited() -> bool:
        status = fleet.node_status(node_id)
        if status is not None:
            seen.add(status)
        return popen.poll() is not None

    fleet.wait_for(exited, 90, f"{name} to exit", log=name)
    log = (fleet.logs / f"{name}.log").read_text(errors="replace")
    assert popen.returncode == 5, fleet.log_tail(name)
    assert "object store mismatch" in log and f"file://{store}" in log, fleet.log_tail(name)
    assert seen == set(), seen  # never listed, so never HEALTHY
    assert node_id not in fleet.nodes()
    assert _sql(fleet, "SELECT count(*) FROM nodes WHERE id = :n", n=node_id) == [(0,)]
    assert _sql(fleet, "SELECT count(*) FROM job_runs WHERE node_id = :n", n=node_id) == [(0,)]
    # the fleet's agents are untouched and still take work
    assert all(fleet.nodes()[h]["status"] == "HEALTHY" for h in fleet.gpu_hosts)
