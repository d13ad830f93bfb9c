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


def test_a_deposed_leaders_late_assign_leaves_the_running_attempt_running(fleet: Fleet) -> None:
    """Issue 7, failures 2 and 7: a late duplicate AssignJob from a controller that lost its
    lease is answered with what the agent knows (ALREADY_RUNNING), and the old controller's
    "never started" conclusion is leader-fenced: the attempt stays RUNNING with its GPUs and
    its process. An epoch from the future is refused and not persisted, so the real leader's
    stop still lands; a standby answers heartbeats with the lease's epoch, not 0."""
    import grpc

    from gpufleet.controller.leadership import Leadership
    from gpufleet.controller.stops import record_never_started
    from gpufleet.rpc.protos import fleet_pb2 as pb
    from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

    fleet.start_agent("a1")
    marker = marker_of(fleet)
    job_id = fleet.submit({"command": py("import time; time.sleep(600)", marker), "gpu_count": 2})
    job = fleet.wait_status(job_id, {"RUNNING"})
    (run,) = job["attempts"]
    epoch = fleet.controller.leadership.epoch
    assert epoch >= 1
    address = fleet.agent_address("a1")
    agents = fleet.controller.agents  # a controller's mutual-TLS clients
    try:
        late = pb.AssignJobRequest(
            run_id=run["run_id"],
            job_id=job_id,
            token=run["token"],
            leader_epoch=epoch - 1,  # the deposed leader's epoch
            gpu_ids=run["gpu_ids"],
            command=job["command"],
            attempt=1,
        )
        answer = agents.assign("a1", address, late)
        assert answer.result == pb.AssignJobResponse.ALREADY_RUNNING, answer

        # the deposed leader concludes "never started" anyway: fenced by the lease
        deposed = Leadership(holder="deposed-controller", epoch=epoch)
        result, why = record_never_started(
            fleet.db,
            fleet.controller.store,
            deposed,
            run_id=run["run_id"],
            token=run["token"],
            message="agent refused it",
        )
        assert result is None, why
        # and even the real leader's inference never overrides a confirmed attempt
        result, why = record_never_started(
            fleet.db,
            fleet.controller.store,
            fleet.controller.leadership,
            run_id=run["run_id"],
            token=run["token"],
            message="agent refused it",
        )
        assert result is not None and result.value == "STALE", why
        got = fleet.job(job_id)
        assert got["status"] == "RUNNING"
        assert got["attempts"][0]["status"] == "RUNNING"
        assert fleet.node("a1")["available_gpus"] == 6

        # an epoch from the future is refused and not believed
        forged = pb.AssignJobRequest(
            run_id="r-forged",
            job_id="j-forged",
            token=1,
            leader_epoch=epoch + 100,
            gpu_ids=[7],
            command=py("import time; time.sleep(600)", marker),
            attempt=1,
        )
        with pytest.raises(grpc.RpcError) as err:
            agents.assign("a1", address, forged)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        pass  # the controller's clients close with the fleet

    # a standby replica answers a heartbeat with the lease's epoch
    from gpufleet.controller.main import Controller
    from gpufleet.queue import InProcWaker
    from gpufleet.rpc import tls
    from tests.ports import free_port

    standby_settings = fleet.settings.model_copy(
        update={"controller_address": f"127.0.0.1:{free_port()}"}
    )
    standby = Controller(standby_settings, fleet.db, InProcWaker())
    standby.start()
    try:
        assert standby.leadership.epoch == 0
        creds = tls.NodeCredentials.load(fleet.tmp / "agents" / "a1" / "tls")
        assert creds is not None
        with tls.secure_channel(
            standby_settings.controller_address,
            tls.channel_credentials(creds.ca_pem, creds.key_pem, creds.chain_pem),
            tls.CONTROLLER_NAME,
        ) as ch:  # as node a1, with its certificate
            resp = pb_grpc.ControllerStub(ch).Heartbeat(
                pb.HeartbeatRequest(node_id="a1", agent_epoch=1), timeout=10
            )
        assert resp.leader_epoch == epoch
    finally:
        standby.stop()

    # the real leader's cancel is obeyed: the forged epoch was not persisted
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 202
    got = fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert got["status"] == "CANCELLED", got
    assert fleet.check() == []
    assert fleet.node("a1")["available_gpus"] == 8


def _kill_group_of(pidfile: Any) -> int:
    import os

    pgid = int(pidfile.read_text())
    os.killpg(pgid, signal.SIGKILL)
    return pgid


def _group_alive(pgid: int) -> bool:
    from gpufleet.agent.procfs import group_members

    return bool(group_members(pgid))


FENCE_S = 6.0


@pytest.mark.fleet_settings(fence_timeout_s=FENCE_S)
def test_a_dead_nodes_jobs_are_replaced_and_its_gpus_quarantined(fleet: Fleet) -> None:
    """Issue 7, failure 3: a node that never comes back. Its running job, a job placed on it
    just after it died, and a cancelled job placed there: within fence timeout + one pass
    the first two run elsewhere under a higher token (no user retry used) and the cancelled
    one is CANCELLED; the dead node's GPUs stay QUARANTINED until an operator fences it."""
    from gpufleet.services import nodes

    fleet.start_agent("a1")
    fleet.start_agent("a2")
    marker = marker_of(fleet)
    pidfile = fleet.tmp / "j.pgid"
    code = (
        f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpgid(0))); time.sleep(600)"
    )
    sleeper = py("import time; time.sleep(600)", marker)
    j = fleet.submit({"command": py(code, marker), "gpu_count": 4, "max_retries": 0})
    first = fleet.wait_status(j, {"RUNNING"})["attempts"][0]
    dead = first["node_id"]
    alive = "a2" if dead == "a1" else "a1"
    fleet.wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the job's pgid")
    fleet.kill_agent(dead)  # the machine dies: its agent and its jobs
    _kill_group_of(pidfile)
    died = time.monotonic()
    k = fleet.submit({"command": sleeper, "gpu_count": 2, "max_retries": 0})
    cancelled = fleet.submit({"command": sleeper, "gpu_count": 2})
    assert fleet.wait_status(k, {"SCHEDULED"})["attempts"][0]["node_id"] == dead
    assert fleet.wait_status(cancelled, {"SCHEDULED"})["attempts"][0]["node_id"] == dead
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{cancelled}").status_code == 202
    # why/status name the node's state while the job waits on it
    fleet.wait_for(
        lambda: [p["status"] for p in fleet.job(k)["node_problems"]] == ["SUSPECT"],
        30,
        "the placed job to show its node SUSPECT",
    )

    def replaced(job_id: str) -> bool:
        got = fleet.job(job_id)
        return got["status"] == "RUNNING" and got["attempts"][-1]["node_id"] == alive

    fleet.wait_for(lambda: replaced(j) and replaced(k), 60, "re-placement on the live node")
    elapsed = time.monotonic() - died
    assert elapsed <= FENCE_S + 4.0, f"re-placed {elapsed:.1f} s after the node died"
    for job_id in (j, k):
        old, new = fleet.job(job_id)["attempts"]
        assert old["status"] == "FENCED" and old["node_id"] == dead
        assert new["token"] > old["token"]
    assert fleet.wait_status(cancelled, TERMINAL, timeout_s=10)["status"] == "CANCELLED"
    node = fleet.node(dead)
    assert node["status"] == "QUARANTINED"
    assert node["available_gpus"] == 0  # 4 + 2 + 2 quarantined: nobody said they are gone
    assert fleet.check() == []
    time.sleep(2)
    assert fleet.node(dead)["available_gpus"] == 0

    # the operator confirms the machine is dead: the GPUs are offered again
    fenced, back = fleet.db.run_write(
        lambda s: nodes.operator_fence(s, dead, reason="machine replaced", max_node_failures=3)
    )
    assert (fenced, back) == ([], 8)
    node = fleet.node(dead)
    assert (node["status"], node["available_gpus"]) == ("FENCED", 8)
    assert fleet.check() == []


@pytest.mark.fleet_settings(fence_timeout_s=FENCE_S)
def test_a_returning_agent_kills_its_fenced_run_before_the_gpus_come_back(fleet: Fleet) -> None:
    """A node frozen past the fence timeout: its job is re-placed elsewhere; when the agent
    comes back it kills the fenced attempt (its process group verified gone) and only then
    are the quarantined GPUs offered again and the node HEALTHY."""
    fleet.start_agent("a1")
    fleet.start_agent("a2")
    marker = marker_of(fleet)
    pidfile = fleet.tmp / "j.pgid"
    code = (
        f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpgid(0))); time.sleep(600)"
    )
    j = fleet.submit({"command": py(code, marker), "gpu_count": 4})
    first = fleet.wait_status(j, {"RUNNING"})["attempts"][0]
    frozen = first["node_id"]
    fleet.wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the job's pgid")
    pgid = int(pidfile.read_text())
    pidfile.unlink()
    fleet.signal_agent(frozen, signal.SIGSTOP)
    fleet.wait_for(lambda: len(fleet.job(j)["attempts"]) == 2, 60, "the job to be re-placed")
    assert fleet.node(frozen)["status"] == "QUARANTINED"
    assert _group_alive(pgid), "the fenced attempt's processes still run on the frozen node"
    assert fleet.node(frozen)["available_gpus"] == 4
    fleet.signal_agent(frozen, signal.SIGCONT)
    fleet.wait_for(lambda: fleet.node(frozen)["status"] == "HEALTHY", 60, "the node back")
    assert not _group_alive(pgid), "GPUs offered while the fenced run still lives"
    assert fleet.node(frozen)["available_gpus"] == 8
    got = fleet.job(j)
    assert got["status"] == "RUNNING" and got["attempts"][0]["status"] == "FENCED"
    assert fleet.check() == []


FILL = """
import os, sys, time
fd = os.open('fill', os.O_WRONLY | os.O_CREAT, 0o600)
try:
    while True:
        os.write(fd, b'x' * 65536)
except OSError:
    pass
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.1)
sys.exit(3)
"""


def test_a_full_disk_makes_the_node_unhealthy_keeps_the_exit_code_and_uses_no_retry(
    fleet: Fleet,
) -> None:
    """Issue 7, failure 4, with a real full disk (a 24 MiB tmpfs as the agent's state dir,
    reserve 8 MiB): the node turns UNHEALTHY and gets no new work (a job refused there is
    re-placed without using its retry), the job that filled the disk keeps its real exit
    code 3, and once its files are collected after upload the node is HEALTHY again."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = fleet.tmp / "small-disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], check=True)
    try:
        fleet.start_agent("a1", state_dir=mnt, env={"GPUFLEET_AGENT_DISK_RESERVE_MB": "8"})
        go = fleet.tmp / "go"
        filler = fleet.submit(
            {"command": [sys.executable, "-c", FILL, str(go)], "gpu_count": 1, "max_retries": 0}
        )
        fleet.wait_for(lambda: fleet.node("a1")["status"] == "UNHEALTHY", 60, "a1 UNHEALTHY")
        assert "disk" in (fleet.node("a1")["status_reason"] or "")
        nxt = fleet.submit({"command": py("print('ok')", marker_of(fleet)), "gpu_count": 1})
        time.sleep(3)
        waiting = fleet.job(nxt)
        assert waiting["status"] == "PENDING", waiting
        for a in waiting["attempts"]:  # refused on a1 before its heartbeat said so
            assert a["status"] == "FAILED" and "node unhealthy" in (a["message"] or "")
        fleet.start_agent("a2")
        done = fleet.wait_status(nxt, TERMINAL, timeout_s=60)
        assert done["status"] == "SUCCEEDED", done  # max_retries 0: no retry was used
        assert done["attempts"][-1]["node_id"] == "a2"
        go.touch()
        ended = fleet.wait_status(filler, TERMINAL, timeout_s=60)
        assert ended["status"] == "FAILED"
        assert ended["attempts"][0]["exit_code"] == 3, ended
        # the disk was really full: the shim could not write its exit file
        agent_log = (fleet.tmp / "agent-a1.log").read_text()
        assert "exit code from the shim's status" in agent_log + str(ended), agent_log
        fleet.wait_for(lambda: fleet.node("a1")["status"] == "HEALTHY", 60, "a1 HEALTHY")
        assert fleet.check() == []
    finally:
        if "a1" in fleet.agents:
            fleet.kill_agent("a1", signal.SIGTERM)
        subprocess.run(["umount", "-l", str(mnt)], check=False)


NOISY = """
import os
line = b'a noisy job writes its log until the disk is full ' * 40 + b'\\n'
try:
    while True:
        os.write(1, line)
except OSError:
    pass
"""
FILLER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
try:
    while True:
        os.write(fd, b'x' * 4096)
except OSError:
    pass
"""


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)  # the agent's disk, not the DB's
def test_a_kept_log_cannot_keep_a_small_disk_full_and_the_agent_starts_on_a_full_disk(
    fleet: Fleet,
) -> None:
    """Issue 24, item 2, on a 4 MiB tmpfs as the agent's state and jobs dir (reserve 1 MiB):
    a job's log fills the disk; once the attempt is reported its kept local dir (over the
    kept-runs bound) is gone, the node is HEALTHY again and the jobs that waited run. Then
    the agent restarts on a disk a filler keeps full: it starts without a traceback, says
    what it needs, reports the node UNHEALTHY with a disk reason, and recovers (HEALTHY,
    the waiting job runs) once the filler is removed."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = fleet.tmp / "tiny-disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    env = {"GPUFLEET_AGENT_DISK_RESERVE_MB": "1"}
    try:
        fleet.start_agent("a1", state_dir=mnt, env=env, args=("--runtime", "none"))
        noisy = fleet.submit({"command": [sys.executable, "-c", NOISY], "gpu_count": 8})
        waiting = [fleet.submit({"command": py("print('ok')", marker_of(fleet))}) for _ in "abc"]
        assert fleet.wait_status(noisy, TERMINAL)["status"] == "SUCCEEDED"
        for j in waiting:  # on main the kept log held the disk full: PENDING for good
            assert fleet.wait_status(j, TERMINAL, timeout_s=30)["status"] == "SUCCEEDED"
        assert fleet.node("a1")["status"] == "HEALTHY"
        with fleet.http() as c:  # its log was uploaded before the local copy went
            assert "a noisy job" in c.get(f"/v1/jobs/{noisy}/logs").text[:2000]

        fleet.kill_agent("a1", signal.SIGTERM)
        filler = mnt / "filler"
        subprocess.run([sys.executable, "-c", FILLER, str(filler)], check=True)
        log = fleet.tmp / "agent-a1.log"
        log.write_text("")
        fleet.start_agent("a1", state_dir=mnt, env=env, args=("--runtime", "none"), wait=False)

        def unhealthy() -> bool:
            assert fleet.agents["a1"].poll() is None, log.read_text()[-3000:]
            node = fleet.node("a1")
            return node["agent_epoch"] == 2 and node["status"] == "UNHEALTHY"

        fleet.wait_for(unhealthy, 30, "the agent up on a full disk, node UNHEALTHY")
        assert "disk" in (fleet.node("a1")["status_reason"] or "")
        text = log.read_text()
        assert "Traceback" not in text, text
        assert "disk full at start" in text and "MiB" in text, text
        later = fleet.submit({"command": py("print('after')", marker_of(fleet))})
        time.sleep(2)
        assert fleet.job(later)["status"] == "PENDING"
        filler.unlink()
        fleet.wait_for(lambda: fleet.node("a1")["status"] == "HEALTHY", 30, "a1 HEALTHY")
        assert fleet.wait_status(later, TERMINAL, timeout_s=30)["status"] == "SUCCEEDED"
        assert fleet.check() == []
    finally:
        if "a1" in fleet.agents:
            fleet.kill_agent("a1", signal.SIGTERM)
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_reinstalled_node_rejoins_under_its_id_and_its_lost_job_runs_again(
    fleet: Fleet,
) -> None:
    """Issue 7, failure 5: the node is re-installed (agent killed, its jobs gone, its state
    dir wiped) and its agent starts again at agent epoch 1: it registers under its id, the
    attempts it cannot know are fenced and the job runs again (a new attempt, higher token),
    and the agent's log never claims the controller is unreachable."""
    import shutil

    fleet.start_agent("a1")
    # restart once normally, so the controller knows agent epoch 2
    fleet.kill_agent("a1", signal.SIGTERM)
    fleet.start_agent("a1", wait=False)
    fleet.wait_for(lambda: fleet.node("a1")["agent_epoch"] == 2, 30, "agent epoch 2")
    marker = marker_of(fleet)
    pidfile = fleet.tmp / "j.pgid"
    code = (
        f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpgid(0))); time.sleep(600)"
    )
    j = fleet.submit({"command": py(code, marker), "gpu_count": 4})
    fleet.wait_status(j, {"RUNNING"})
    fleet.wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the job's pgid")
    fleet.kill_agent("a1")  # the machine is re-installed: agent, jobs and state are gone
    _kill_group_of(pidfile)
    pidfile.unlink()
    shutil.rmtree(fleet.tmp / "agents" / "a1")  # re-installed: the state dir is gone
    log = fleet.tmp / "agent-a1.log"
    log.write_text("")
    fleet.start_agent("a1", wait=False)
    fleet.wait_for(lambda: fleet.node("a1")["agent_epoch"] == 1, 30, "the fresh agent")

    def runs_again() -> bool:
        got = fleet.job(j)
        return got["status"] == "RUNNING" and len(got["attempts"]) >= 2

    fleet.wait_for(runs_again, 60, "the job to run again")
    old, new = fleet.job(j)["attempts"][:2]
    assert old["status"] == "FENCED" and new["token"] > old["token"]
    assert "not reachable" not in log.read_text()
    assert fleet.check() == []


BACKOFF_S = 2.0


@pytest.mark.fleet_settings(retry_backoff_s=BACKOFF_S)
def test_retries_back_off_exponentially_and_why_says_so(fleet: Fleet) -> None:
    """Issue 7, failure 6: a job that exits 3 is retried after an exponential backoff with
    jitter (at least base x 2^(n-1) x 0.5 between attempts), and while it waits ``why``
    says "retrying in N s after exit code 3"."""
    fleet.start_agent("a1")
    j = fleet.submit(
        {
            "command": py("import sys; sys.exit(3)", marker_of(fleet)),
            "gpu_count": 1,
            "max_retries": 2,
        }
    )
    seen: list[str] = []

    def backing_off() -> bool:
        got = fleet.job(j)
        reason = got.get("pending_reason") or {}
        if reason.get("code") == "retry_backoff":
            seen.append(reason["message"])
        return got["status"] in TERMINAL

    fleet.wait_for(backing_off, 60, "the job to use its retries")
    got = fleet.job(j)
    assert got["status"] == "FAILED"
    assert [a["exit_code"] for a in got["attempts"]] == [3, 3, 3]
    assert seen and all(
        m.startswith("retrying in ") and m.endswith(" s after exit code 3") for m in seen
    ), seen
    ts = [
        (
            datetime.fromisoformat(a["created_at"].replace("Z", "+00:00")),
            datetime.fromisoformat(a["finished_at"].replace("Z", "+00:00")),
        )
        for a in got["attempts"]
    ]
    for n in (1, 2):
        gap = (ts[n][0] - ts[n - 1][1]).total_seconds()
        assert gap >= BACKOFF_S * 2 ** (n - 1) * 0.5 - 0.05, (n, gap)


def test_a_stop_sent_while_the_agent_restarts_lands_within_seconds(fleet: Fleet) -> None:
    """Issue 7, failure 6: a cancel while the agent is down: once the agent is back, the
    StopRun is re-sent within seconds (backoff), not after grace + 10 s."""
    fleet.start_agent("a1")
    j = fleet.submit(
        {"command": py("import time; time.sleep(600)", marker_of(fleet)), "gpu_count": 1}
    )
    fleet.wait_status(j, {"RUNNING"})
    fleet.kill_agent("a1")  # the job keeps running under its shim
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{j}").status_code == 202
    time.sleep(3)  # several StopRuns fail meanwhile
    fleet.start_agent("a1", wait=False)
    fleet.wait_for(lambda: fleet.node("a1")["agent_epoch"] == 2, 30, "the agent back")
    back = time.monotonic()
    got = fleet.wait_status(j, TERMINAL, timeout_s=60)
    elapsed = time.monotonic() - back
    assert got["status"] == "CANCELLED", got
    assert elapsed <= 5.0 + GRACE_S, f"the stop landed {elapsed:.1f} s after the restart"
    assert fleet.check() == []


def admin_env(fleet: Fleet) -> dict[str, str]:
    """The environment of an operator's ``gpufleet admin`` call: the fleet's API and an admin
    token (made once per fleet)."""
    import os

    from gpufleet.services import auth

    if "_admin" not in fleet.tokens:
        fleet.tokens["_admin"] = fleet.db.run_write(
            lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
        )
    env = dict(
        os.environ,
        GPUFLEET_DATA_DIR=str(fleet.tmp),
        GPUFLEET_URL=fleet.api.url,
        GPUFLEET_TOKEN=fleet.tokens["_admin"],
        GPUFLEET_CONFIG=str(fleet.tmp / "none.yaml"),
    )
    if fleet.settings.database_url is not None:
        env["GPUFLEET_DATABASE_URL"] = fleet.settings.database_url.get_secret_value()
    return env


def gpufleet_cli(fleet: Fleet, *args: str, timeout: float = 60) -> Any:
    """Run the real ``gpufleet`` command against the fleet (admin commands: its API, with an
    admin token)."""
    import subprocess

    env = admin_env(fleet)
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_operator_cordon_drain_and_fence_and_why_names_the_nodes(fleet: Fleet) -> None:
    """Issue 7, operator commands: cordon with a reason, drain (waits, shows what runs), and
    fence --confirm-dead; ``why`` names each node a waiting job cannot use and why."""
    import subprocess

    fleet.start_agent("a1")
    fleet.start_agent("a2")
    marker = marker_of(fleet)
    j = fleet.submit({"command": py("import time; time.sleep(600)", marker), "gpu_count": 4})
    x = fleet.wait_status(j, {"RUNNING"})["attempts"][0]["node_id"]
    y = "a2" if x == "a1" else "a1"
    r = gpufleet_cli(fleet, "admin", "node", "cordon", y, "--reason", "fan failure")
    assert r.returncode == 0, r.stderr
    assert (fleet.node(y)["status"], fleet.node(y)["status_reason"]) == ("CORDONED", "fan failure")
    k = fleet.submit({"command": py("print('k')", marker), "gpu_count": 8})
    fleet.wait_for(lambda: fleet.job(k).get("node_problems"), 30, "why to name the node")
    assert fleet.job(k)["node_problems"] == [
        {"node_id": y, "status": "CORDONED", "reason": "fan failure"}
    ]

    env = admin_env(fleet)
    drain = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "admin",
            "node",
            "drain",
            x,
            "--reason",
            "kernel upgrade",
            "--timeout",
            "60",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    fleet.wait_for(lambda: fleet.node(x)["status"] == "DRAINING", 30, "the drain to start")
    time.sleep(2)
    assert drain.poll() is None, "drain returned while an attempt still runs"
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{j}").status_code == 202
    text, _ = drain.communicate(timeout=60)
    assert drain.returncode == 0, text
    assert f"waiting for 1 attempt(s): {j} (RUNNING)" in text
    assert "drained" in text
    fleet.wait_for(lambda: fleet.node(x)["status"] == "CORDONED", 30, "drained -> CORDONED")

    r = gpufleet_cli(fleet, "admin", "node", "fence", x)
    assert r.returncode == 2 and "--confirm-dead" in r.stderr
    fleet.kill_agent(x)
    # fence --confirm-dead refuses a node heard from within the heartbeat window
    time.sleep(fleet.settings.heartbeat_interval_s * fleet.settings.suspect_after_missed + 0.5)
    r = gpufleet_cli(fleet, "admin", "node", "fence", x, "--confirm-dead", "--reason", "RMA")
    assert r.returncode == 0, r.stderr
    assert "FENCED" in r.stdout
    assert fleet.node(x)["status"] == "FENCED"
    fleet.wait_for(lambda: len(fleet.job(k)["node_problems"]) == 2, 30, "both nodes named")
    why = gpufleet_cli(fleet, "why", k, "--url", fleet.api.url, "--token", fleet.tokens["vision"])
    assert f"node {y} is CORDONED: fan failure" in why.stdout, why.stdout + why.stderr
    assert f"node {x} is FENCED" in why.stdout, why.stdout
    r = gpufleet_cli(fleet, "admin", "node", "uncordon", y)
    assert r.returncode == 0, r.stderr
    assert fleet.wait_status(k, TERMINAL, timeout_s=60)["status"] == "SUCCEEDED"
    assert fleet.check() == []


def test_an_agent_restarted_with_another_gpu_count_while_busy_drains_and_keeps_its_job(
    fleet: Fleet,
) -> None:
    """An agent restarted with a different GPU count while its node runs work (a typo in
    --gpus, a GPU fallen off the bus) registers: the node keeps its recorded GPUs and goes
    DRAINING with the reason, nothing new lands there, and the running attempt ends with its
    own exit code (it used to be refused registration until the node was quarantined and its
    work fenced and run again, losing the exit code). Once drained (CORDONED), uncordon is
    refused until the agent registers again; the next restart takes the new count, and
    uncordon makes the node usable."""
    fleet.start_agent("a1", gpus="4xH100-80GB")
    done = fleet.tmp / "go"
    code = (
        f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.1)\n"
        "raise SystemExit(7)"
    )
    j = fleet.submit({"command": py(code, marker_of(fleet)), "gpu_count": 2, "max_retries": 0})
    fleet.wait_status(j, {"RUNNING"})
    fleet.kill_agent("a1")  # the job keeps running under its shim
    fleet.start_agent("a1", gpus="2xH100-80GB", wait=False)
    fleet.wait_for(lambda: fleet.node("a1")["status"] == "DRAINING", 30, "a1 DRAINING")
    node = fleet.node("a1")
    assert node["total_gpus"] == 4 and "now reports 2" in (node["status_reason"] or ""), node
    late = fleet.submit({"command": py("pass", marker_of(fleet)), "gpu_count": 1})
    done.write_text("")
    ended = fleet.wait_status(j, TERMINAL, timeout_s=60)
    assert ended["status"] == "FAILED" and len(ended["attempts"]) == 1, ended
    assert ended["attempts"][0]["exit_code"] == 7, ended
    fleet.wait_for(lambda: fleet.node("a1")["status"] == "CORDONED", 30, "drained a1")
    assert fleet.job(late)["status"] == "PENDING"  # nothing new on a draining node
    # the recorded GPUs are not the agent's until it registers again: no uncordon before
    r = gpufleet_cli(fleet, "admin", "node", "uncordon", "a1")
    assert r.returncode != 0 and "restart its agent" in r.stdout + r.stderr, r
    fleet.kill_agent("a1", signal.SIGTERM)
    fleet.start_agent("a1", gpus="2xH100-80GB", wait=False)
    fleet.wait_for(lambda: fleet.node("a1")["total_gpus"] == 2, 30, "the new count")
    assert fleet.node("a1")["status"] == "CORDONED"
    r = gpufleet_cli(fleet, "admin", "node", "uncordon", "a1")
    assert r.returncode == 0, r.stderr
    assert fleet.wait_status(late, TERMINAL, timeout_s=60)["status"] == "SUCCEEDED"
    assert fleet.check() == []
