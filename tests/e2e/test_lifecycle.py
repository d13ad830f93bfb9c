"""Acceptance scenarios of the whole lifecycle, with real agents and real job processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.procfs import group_members
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "train_digits.py")


def py(code: str, marker: str) -> list[str]:
    """A job command: a Python snippet (the marker lets the harness find stray processes)."""
    return [sys.executable, "-c", code, marker]


def test_forty_jobs_of_mixed_sizes_on_two_agents_all_succeed(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    fleet.start_agent("a2")
    fleet.start_sampling()
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    code = (
        "import os, time; g = os.environ['CUDA_VISIBLE_DEVICES'].split(',');"
        " time.sleep(0.3); print('ran on', len(g), 'gpus')"
    )
    jobs = []
    for i in range(40):
        gpus = (1, 2, 4, 8)[i % 4]
        team = ("vision", "nlp")[i % 2]
        jobs.append(
            (
                team,
                gpus,
                fleet.submit(
                    {"command": py(code, marker), "gpu_count": gpus, "name": f"mix-{i}"}, team
                ),
            )
        )
    for team, gpus, job_id in jobs:
        got = fleet.wait_status(job_id, TERMINAL, timeout_s=120, team=team)
        assert got["status"] == "SUCCEEDED", got
        (attempt,) = got["attempts"]
        assert len(attempt["gpu_ids"]) == gpus
    assert fleet.samples > 5
    assert fleet.violations == []
    assert fleet.check() == []
    nodes = fleet.get("/v1/nodes")["items"]
    assert [(n["node_id"], n["available_gpus"]) for n in nodes] == [("a1", 8), ("a2", 8)]


def test_cancel_stops_the_process_group_before_the_gpus_are_released(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    pidfile = fleet.tmp / "pid"
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    code = (  # ignores SIGTERM: only the SIGKILL after the grace period stops it
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        f" open({str(pidfile)!r}, 'w').write(str(os.getpgid(0)));"
        " time.sleep(600)"
    )
    job_id = fleet.submit({"command": py(code, marker), "gpu_count": 4})
    fleet.wait_status(job_id, {"RUNNING"})
    fleet.wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the job's pid file")
    pgid = int(pidfile.read_text())
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 202
    released_while_alive = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # capacity first, then liveness: GPUs seen free while the group still lives = violation
        free = fleet.get("/v1/nodes")["items"][0]["available_gpus"]
        alive = _group_alive(pgid)
        if alive and free != 4:
            released_while_alive.append(free)
        if not alive and fleet.job(job_id)["status"] in TERMINAL:
            break
        time.sleep(0.05)
    job = fleet.wait_status(job_id, TERMINAL)
    assert released_while_alive == []
    assert not _group_alive(pgid)
    assert job["status"] == "CANCELLED"
    assert job["attempts"][0]["status"] == "CANCELLED"
    assert fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 8
    assert fleet.check() == []


def test_kill_9_agent_mid_job_then_restart_runs_the_job_once(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    starts = fleet.tmp / "starts"
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    code = (
        f"import time; open({str(starts)!r}, 'a').write('started\\n'); time.sleep(4);"
        " print('done')"
    )
    job_id = fleet.submit({"command": py(code, marker), "gpu_count": 2})
    fleet.wait_status(job_id, {"RUNNING"})
    fleet.wait_for(lambda: starts.exists(), 10, "the job to start")
    fleet.kill_agent("a1", signal.SIGKILL)
    time.sleep(1.0)
    fleet.start_agent("a1", wait=False)
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert job["status"] == "SUCCEEDED", job
    assert starts.read_text().splitlines() == ["started"]
    assert len(job["attempts"]) == 1 and job["attempts"][0]["exit_code"] == 0
    with fleet.http() as c:
        assert "done" in c.get(f"/v1/jobs/{job_id}/logs").text
    assert fleet.check() == []


def test_failed_job_is_retried_as_a_new_attempt_then_fails(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    job_id = fleet.submit(
        {
            "command": py("import sys; print('boom'); sys.exit(3)", marker),
            "gpu_count": 1,
            "max_retries": 1,
        }
    )
    job = fleet.wait_status(job_id, TERMINAL)
    assert job["status"] == "FAILED"
    first, second = job["attempts"]
    assert first["run_id"] != second["run_id"]
    assert second["token"] > first["token"]
    assert (first["exit_code"], second["exit_code"]) == (3, 3)
    assert "3" in job["failure_reason"]
    assert fleet.check() == []


def test_example_workload_resumes_from_its_checkpoint_after_a_failure(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    job_id = fleet.submit(
        {
            "command": [
                sys.executable,
                TRAIN,
                "--steps",
                "120",
                "--checkpoint-every",
                "40",
                "--fail-at-step",
                "80",
                "--step-sleep",
                "0",
            ],
            "gpu_count": 2,
            "max_retries": 1,
            "env": {"PYTHONUNBUFFERED": "1"},
        }
    )
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=90)
    first, second = job["attempts"]
    assert first["exit_code"] == 3 and job["status"] == "SUCCEEDED", job
    with fleet.http() as c:
        log = c.get(f"/v1/jobs/{job_id}/logs", params={"run_id": second["run_id"]}).text
    assert "resumed from step 80" in log


def _group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the group (zombies of a killed job that no init reaps
    hold no GPU)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return bool(group_members(pgid))


def test_a_job_that_cannot_start_fails_at_once_and_frees_its_gpus(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    job_id = fleet.submit({"command": ["true"], "gpu_count": 4, "working_dir": "/nonexistent/dir"})
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=30)
    assert job["status"] == "FAILED"
    assert "never started" in job["attempts"][0]["message"]
    assert fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 8
    assert fleet.check() == []


def test_the_job_starts_in_its_working_dir(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    job_id = fleet.submit(
        {
            "command": py("import os; print('cwd', os.getcwd())", marker),
            "gpu_count": 1,
            "working_dir": str(fleet.tmp),
        }
    )
    assert fleet.wait_status(job_id, TERMINAL)["status"] == "SUCCEEDED"
    with fleet.http() as c:
        assert f"cwd {fleet.tmp}" in c.get(f"/v1/jobs/{job_id}/logs").text


def test_a_second_agent_on_the_same_state_dir_refuses_to_start(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "agent",
            "--node-id",
            "a1",
            "--gpus",
            "8xH100-80GB",
            "--state-dir",
            str(fleet.tmp / "agents" / "a1"),
        ],
        env={**os.environ, "GPUFLEET_CONTROLLER_ADDRESS": fleet.settings.controller_address},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert second.returncode == 3
    assert "another agent" in second.stderr


def test_following_the_logs_of_a_pending_job_waits_for_its_attempt(fleet: Fleet) -> None:
    fleet.start_agent("a1", gpus="2xA100-40GB")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    blocker = fleet.submit({"command": py("import time; time.sleep(60)", marker), "gpu_count": 2})
    fleet.wait_status(blocker, {"RUNNING"})
    waiting = fleet.submit(
        {"command": py("print('hello after the wait')", marker), "gpu_count": 2}
    )
    got: list[str] = []

    def follow() -> None:
        with (
            fleet.http() as c,
            c.stream(
                "GET", f"/v1/jobs/{waiting}/logs", params={"follow": "true"}, timeout=60
            ) as r,
        ):
            got.append(r.read().decode())

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and not got  # still waiting: no attempt yet
    with fleet.http() as c:
        c.delete(f"/v1/jobs/{blocker}")
    t.join(timeout=60)
    assert got and "hello after the wait" in got[0]


def test_the_controller_learns_the_newest_checkpoint_file_time(fleet: Fleet) -> None:
    """A job writes into $GPUFLEET_CHECKPOINT_DIR; its agent's heartbeats bring the file's
    time to the attempt's row (``job_runs.last_checkpoint_at``), which prices a preemption."""
    from gpufleet.store.tables import JobRunRow

    fleet.start_agent("a1")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    code = (
        "import os, pathlib, time;"
        " f = pathlib.Path(os.environ['GPUFLEET_CHECKPOINT_DIR']) / 'step-1.pt';"
        " f.write_bytes(b'weights'); os.utime(f, (time.time() - 30, time.time() - 30));"
        " time.sleep(600)"
    )
    job_id = fleet.submit({"command": py(code, marker), "gpu_count": 1})
    fleet.wait_status(job_id, {"RUNNING"})
    run_id = fleet.job(job_id)["attempts"][0]["run_id"]

    def stored() -> Any:
        with fleet.db.read() as s:
            run = s.get(JobRunRow, run_id)
            return None if run is None else run.last_checkpoint_at

    fleet.wait_for(lambda: stored() is not None, 20, "the checkpoint time on the attempt's row")
    with fleet.db.read() as s:
        run = s.get(JobRunRow, run_id)
        assert run is not None and run.started_at is not None
        age_s = (run.started_at - run.last_checkpoint_at).total_seconds()
    assert 20 < age_s < 40  # the file's time (30 s before it was written), not the start
    # and the user sees it on the attempt (GET /v1/jobs/{id}, `gpufleet status --wide`)
    shown = fleet.job(job_id)["attempts"][0]["last_checkpoint_at"]
    kept = stored()
    kept = kept if kept.tzinfo is not None else kept.replace(tzinfo=UTC)
    assert shown is not None
    seen = datetime.fromisoformat(shown)
    seen = seen if seen.tzinfo is not None else seen.replace(tzinfo=UTC)
    assert abs(seen.timestamp() - kept.timestamp()) < 1.0
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 202
    assert fleet.wait_status(job_id, TERMINAL)["status"] == "CANCELLED"
    assert fleet.check() == []
