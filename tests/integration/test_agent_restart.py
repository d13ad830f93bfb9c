"""Agent restarts: kill -9 mid-run, and a crash between logging an assignment and logging its
start. Real processes, real signals, real gRPC; the controller is a fake that records calls."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from gpufleet.agent import shim
from gpufleet.agent.assignment_log import AssignmentLog
from gpufleet.agent.main import run_agent
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from tests.integration.test_agent_support import (
    LEADER_EPOCH,
    FakeController,
    agent_subprocess,
    fake_controller,
    inprocess_agent,
    kill_leftover_groups,
    make_settings,
    test_pki,
    wait_until,
)
from tests.ports import free_port

A = pb.AssignJobResponse
R = pb.ReportCompletionRequest


def _job(starts: Path, exit_code: int, go: Path | None = None) -> list[str]:
    """A job that appends one line per start to ``starts``, waits until the file ``go`` exists
    (if given), then exits with ``exit_code``."""
    code = (
        f"import os, sys, time; open({str(starts)!r}, 'a').write('start\\n')\n"
        f"while {str(go)!r} != 'None' and not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
        f"sys.exit({exit_code})"
    )
    return [sys.executable, "-c", code]


def _stub(fake: FakeController, epoch: int) -> tuple[grpc.Channel, pb_grpc.AgentStub]:
    reg = fake.wait_for(lambda: [r for r in fake.registrations if r.agent_epoch == epoch], 20)[0]
    channel = test_pki().agent_channel(reg.address, reg.node_id)
    return channel, pb_grpc.AgentStub(channel)


def _assign(stub: pb_grpc.AgentStub, run_id: str, command: list[str]) -> pb.AssignJobResponse:
    return stub.AssignJob(
        pb.AssignJobRequest(
            run_id=run_id,
            job_id=f"j-{run_id}",
            token=1,
            leader_epoch=LEADER_EPOCH,
            gpu_ids=[0] if run_id.endswith("a") else [1],
            command=command,
            attempt=1,
        ),
        timeout=30,
    )


@pytest.mark.slow
@pytest.mark.chaos
def test_kill_9_agent_mid_run_then_restart_adopts_and_reports_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    starts_a, starts_b = tmp_path / "starts-a", tmp_path / "starts-b"
    go_a, go_b = tmp_path / "go-a", tmp_path / "go-b"
    with fake_controller() as (fake, address):
        agent = agent_subprocess(address, tmp_path, state)
        try:
            channel, stub = _stub(fake, 1)
            # a: ends while the agent is down. b: still running when the agent comes back.
            assert _assign(stub, "r-a", _job(starts_a, 5, go_a)).result == A.STARTED
            assert _assign(stub, "r-b", _job(starts_b, 7, go_b)).result == A.STARTED
            fake.wait_for(lambda: {c.run_id for c in fake.confirms} >= {"r-a", "r-b"})
            channel.close()

            agent.kill()  # SIGKILL: no cleanup of any kind
            agent.wait()
            go_a.touch()
            wait_until(lambda: (state / "runs/r-a/exit.json").exists(), timeout_s=10)
            assert not fake.reports, "nobody was left to report"

            agent = agent_subprocess(address, tmp_path, state)
            channel, stub = _stub(fake, 2)
            report_a = fake.wait_report("r-a", timeout_s=15)
            again = [_assign(stub, "r-a", ["true"]), _assign(stub, "r-b", ["true"])]
            go_b.touch()
            report_b = fake.wait_report("r-b", timeout_s=15)
            time.sleep(3 * 0.1 + 0.5)  # a few heartbeats: room for a duplicate report to show
            channel.close()

            assert (report_a.outcome, report_a.exit_code) == (R.EXITED, 5)
            assert (report_b.outcome, report_b.exit_code) == (R.EXITED, 7)
            assert [len(fake.reports_for(r)) for r in ("r-a", "r-b")] == [1, 1]
            assert [a.result for a in again] == [A.ALREADY_EXITED, A.ALREADY_RUNNING]
            assert starts_a.read_text() == starts_b.read_text() == "start\n"
            assert json.loads((state / "agent_epoch").read_text()) == 2

            agent.send_signal(signal.SIGTERM)  # a clean agent stop exits 0
            assert agent.wait(timeout=20) == 0
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            kill_leftover_groups(state)


def test_waits_for_the_controller_and_reports_what_ran_meanwhile(tmp_path: Path) -> None:
    """The agent starts before the controller; registration is retried with backoff, and no
    confirmation or report is sent before the node is registered."""
    port = free_port()
    state = tmp_path / "state"
    log = AssignmentLog(state)  # an attempt that ended while nothing was up
    log.append(
        "assigned",
        "r-early",
        job_id="j-early",
        token=1,
        leader_epoch=1,
        gpu_ids=[0],
        command=["true"],
        env={},
        attempt=1,
    )
    log.append("start_failed", "r-early", message="boom")
    log.close()
    settings = make_settings(f"127.0.0.1:{port}", tmp_path)
    test_pki().provision(state, "n-late")
    stop = threading.Event()
    agent = threading.Thread(
        target=run_agent,
        kwargs={
            "settings": settings,
            "node_id": "n-late",
            "gpus": "1xL4-24GB",
            "port": 0,
            "state_dir": state,
            "labels": {},
            "heartbeat_interval_s": 0.1,
            "stop_event": stop,
        },
    )
    agent.start()
    try:
        time.sleep(0.5)  # the controller is down for a while
        with fake_controller(port) as (fake, _):
            report = fake.wait_report("r-early")
            assert fake.calls[0] == ("register", "")
        assert (report.outcome, report.message) == (R.NEVER_STARTED, "boom")
    finally:
        stop.set()
        agent.join(timeout=20)


class TestCrashBetweenAssignedAndStarted:
    """The agent logged ``assigned`` and died before logging ``started``."""

    def _log_assigned(self, state: Path, run_id: str, command: list[str]) -> None:
        log = AssignmentLog(state)
        log.append(
            "assigned",
            run_id,
            job_id=f"j-{run_id}",
            token=1,
            leader_epoch=1,
            gpu_ids=[0],
            command=command,
            env={},
            attempt=1,
        )
        log.close()

    def test_no_shim_yet_means_never_started_and_never_starts_later(self, tmp_path: Path) -> None:
        state = tmp_path / "state"
        starts = tmp_path / "starts"
        self._log_assigned(state, "r-cut", _job(starts, 0))
        with fake_controller() as (fake, address):
            settings = make_settings(address, tmp_path)
            with inprocess_agent(fake, settings, state) as agent:
                report = fake.wait_report("r-cut")
                resp = agent.assign(
                    run_id="r-cut", job_id="j-r-cut", token=1, command=_job(starts, 0)
                )
        assert report.outcome == R.NEVER_STARTED
        assert "restarted before the start completed" in report.message
        assert resp.result == A.FAILED_TO_START
        # A shim that was still starting when the agent died loses the race for the claim:
        shim = _run_shim(state, "r-cut", _job(starts, 0))
        assert shim.returncode == 0
        assert not starts.exists()

    def test_shim_that_claimed_the_start_is_adopted(self, tmp_path: Path) -> None:
        state = tmp_path / "state"
        starts = tmp_path / "starts"
        self._log_assigned(state, "r-won", _job(starts, 9))
        shim = _run_shim(state, "r-won", _job(starts, 9))  # the shim won the race
        assert shim.returncode == 0
        with fake_controller() as (fake, address):
            settings = make_settings(address, tmp_path)
            with inprocess_agent(fake, settings, state):
                report = fake.wait_report("r-won")
                fake.wait_for(lambda: [c for c in fake.confirms if c.run_id == "r-won"])
        assert (report.outcome, report.exit_code) == (R.EXITED, 9)
        assert starts.read_text() == "start\n"


def _run_shim(state: Path, run_id: str, command: list[str]) -> subprocess.CompletedProcess[bytes]:
    run_dir = state / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = shim.argv(
        exit_file=run_dir / "exit.json",
        log_file=run_dir / "output.log",
        claim_file=run_dir / "shim.json",
        command=command,
    )
    return subprocess.run(
        argv,
        start_new_session=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("boot_id", "ticks_delta", "want_message"),
    [
        pytest.param(None, -1, "exit status lost", id="pid reused by another group leader"),
        pytest.param("another-boot", 0, "rebooted", id="started before a reboot"),
    ],
)
def test_adoption_never_signals_a_stranger(tmp_path, boot_id, ticks_delta, want_message) -> None:
    """The logged shim pid now belongs to an unrelated group leader: report the attempt as
    ended, and leave the stranger alone."""
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        ticks = int(Path(f"/proc/{stranger.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        current_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        state = tmp_path / "state"
        log = AssignmentLog(state)
        log.append(
            "assigned",
            "r-old",
            job_id="j-old",
            token=1,
            leader_epoch=1,
            gpu_ids=[0],
            command=["train"],
            env={},
            attempt=1,
        )
        log.append(
            "started",
            "r-old",
            pid=stranger.pid,
            shim_pid=stranger.pid,
            shim_start_ticks=ticks + ticks_delta,
            boot_id=boot_id or current_boot,
        )
        log.append("confirmed", "r-old", result="CONFIRMED")
        log.close()
        with fake_controller() as (fake, address):
            settings = make_settings(address, tmp_path)
            with inprocess_agent(fake, settings, state):
                report = fake.wait_report("r-old")
        assert (report.outcome, report.exit_code) == (R.EXITED, -signal.SIGKILL)
        assert want_message in report.message
        assert stranger.poll() is None, "the stranger was signalled"
    finally:
        stranger.kill()
        stranger.wait()
