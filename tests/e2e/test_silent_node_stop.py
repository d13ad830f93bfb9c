"""A job cancelled while its node is silent (agent frozen with SIGSTOP; its job process runs
on, as on a network partition), with real processes (issue 24, items 5 and 6):

* the stop waits for the fence, as designed: ``gpufleet admin check`` polled during that wait
  must not report a VIOLATION (on main: "stopping for 40 s (grace 2 s + 30 s)", exit 1);
* once the node is fenced the job shows CANCELLED at once while its process still runs: the
  job view must say so (``processes_unverified``, through REST, the SDK, ``status``, ``why``
  and the dashboard) until the agent comes back and reports the process gone.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from gpufleet.cli.main import app as cli_app
from gpufleet.client import Client
from gpufleet.store.tables import JobRunRow, NodeRow
from tests.e2e.harness import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def alive(marker: str) -> bool:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0


def running_job(fleet: Fleet, marker: str) -> str:
    fleet.start_agent("a1", gpus="2xH100-80GB")
    job = fleet.submit({"command": [sys.executable, "-c", "import time; time.sleep(120)", marker]})
    fleet.wait_status(job, {"RUNNING"}, 30)
    fleet.wait_for(lambda: alive(marker), 10, "the job's process")
    return job


def freeze_and_cancel(fleet: Fleet, job: str) -> None:
    fleet.signal_agent("a1", signal.SIGSTOP)
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{job}").status_code == 202
    fleet.wait_for(
        lambda: fleet.job(job)["attempts"][-1]["status"] == "PREEMPTING", 10, "PREEMPTING"
    )


def admin_check(fleet: Fleet) -> tuple[int, str]:
    """``gpufleet admin check`` on the fleet's database with its settings: (exit code, output)."""
    env = {
        "GPUFLEET_DATA_DIR": str(fleet.tmp),
        "GPUFLEET_CONFIG": str(fleet.tmp / "absent.yaml"),
        "GPUFLEET_DEFAULT_GRACE_S": str(fleet.settings.default_grace_s),
        "GPUFLEET_HEARTBEAT_INTERVAL_S": str(fleet.settings.heartbeat_interval_s),
        "GPUFLEET_FENCE_TIMEOUT_S": str(fleet.settings.fence_timeout_s),
        "GPUFLEET_CONFIRM_TIMEOUT_S": str(fleet.settings.confirm_timeout_s),
    }
    got = CliRunner().invoke(cli_app, ["admin", "check"], env=env)
    assert "Traceback" not in got.output, got.output
    return got.exit_code, got.output


def move_back(fleet: Fleet, run_id: str, seconds: float) -> None:
    """Let ``seconds`` of the fence wait pass at once: the stop request and the node's last
    heartbeat moved that far into the past together (the stuck-check tests' way; the
    controller's own listening time is unchanged, so nothing is fenced meanwhile)."""

    def back(s: Session) -> None:
        delta = timedelta(seconds=seconds)
        run, node = s.get(JobRunRow, run_id), s.get(NodeRow, "a1")
        assert run is not None and node is not None
        assert run.stop_requested_at is not None and node.last_heartbeat_at is not None
        run.stop_requested_at -= delta
        node.last_heartbeat_at -= delta

    fleet.db.run_write(back)


def test_admin_check_waits_for_the_fence_of_a_silent_nodes_stop(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, fence_timeout_s=60.0).start(teams=("vision",))
    marker = f"gpufleet-test-marker-{tmp_path.name}"
    try:
        job = running_job(fleet, marker)
        freeze_and_cancel(fleet, job)
        run_id = fleet.job(job)["attempts"][-1]["run_id"]
        move_back(fleet, run_id, 40)  # stopping 40 s, the node silent as long: fence at 61 s
        for _ in range(3):
            code, out = admin_check(fleet)
            assert code == 0 and "VIOLATION" not in out, out
            time.sleep(0.5)
        # past the fence (+ one heartbeat + 30 s) a stop that still has not ended is stuck
        move_back(fleet, run_id, 60)
        code, out = admin_check(fleet)
        assert code == 1 and "VIOLATION" in out, out
        assert re.search(r"stopping for 1\d\d s \(its node a1 silent", out), out
    finally:
        if "a1" in fleet.agents:  # frozen with a stop it never heard: no graceful exit
            fleet.signal_agent("a1", signal.SIGCONT)
            fleet.kill_agent("a1", signal.SIGKILL)
        fleet.stop()


def test_a_cancelled_job_on_a_fenced_node_says_its_process_may_run_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = Fleet(tmp_path, fence_timeout_s=4.0).start(teams=("vision",))
    marker = f"gpufleet-test-marker-{tmp_path.name}"
    try:
        job = running_job(fleet, marker)
        freeze_and_cancel(fleet, job)
        got = fleet.wait_status(job, {"CANCELLED"}, 30)  # the fence: CANCELLED at once
        assert alive(marker)  # ... while its process runs on
        attempt = got["attempts"][-1]
        assert attempt["status"] == "FENCED"
        assert "processes not verified gone: node a1 unreachable" in (
            attempt["processes_unverified"] or ""
        ), attempt
        assert got["processes_unverified"].startswith(f"attempt {attempt['run_id']}: ")

        with Client(fleet.api.url, fleet.tokens["vision"]) as sdk:
            seen = sdk.get(job)
            assert seen.processes_unverified and "node a1 unreachable" in seen.processes_unverified
            assert seen.attempts[-1].processes_unverified
        monkeypatch.setenv("GPUFLEET_URL", fleet.api.url)
        monkeypatch.setenv("GPUFLEET_TOKEN", fleet.tokens["vision"])
        monkeypatch.setenv("GPUFLEET_CONFIG", str(tmp_path / "absent.yaml"))
        for cmd in ("status", "why"):
            out = CliRunner().invoke(cli_app, [cmd, job]).output
            assert "processes not verified gone" in out, out
        with httpx.Client(base_url=fleet.api.url, timeout=30) as ui:  # the dashboard
            page = ui.get("/ui/login").text
            csrf = re.search(r'name="csrf" value="([^"]*)"', page)
            assert csrf
            ui.post("/ui/login", data={"token": fleet.tokens["vision"], "csrf": csrf.group(1)})
            assert "processes not verified gone" in ui.get(f"/ui/jobs/{job}").text

        fleet.signal_agent("a1", signal.SIGCONT)  # the agent is back: it stops the process
        fleet.wait_for(
            lambda: fleet.job(job)["processes_unverified"] is None, 30, "the agent's report"
        )
        assert fleet.job(job)["attempts"][-1]["processes_unverified"] is None
        fleet.wait_for(lambda: not alive(marker), 10, "the process gone")
    finally:
        fleet.stop()
