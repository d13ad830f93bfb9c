"""The user-facing commands against a real platform, and the README's first command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import Fleet

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def cli(
    fleet: Fleet, *args: str, team: str = "vision", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        GPUFLEET_URL=fleet.api.url,
        GPUFLEET_TOKEN=fleet.tokens[team],
        GPUFLEET_CONFIG=str(fleet.tmp / "none.yaml"),
    )
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_submit_wait_logs_status_list_through_the_cli(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    sub = cli(
        fleet,
        "submit",
        "--gpus",
        "2",
        "--name",
        "hello",
        "--wait",
        "--",
        sys.executable,
        "-c",
        "[print('line', i) for i in range(1500)];"
        "print('hello from', __import__('os').environ['CUDA_VISIBLE_DEVICES'])",
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().splitlines()[0]
    logs = cli(fleet, "logs", job_id)  # the last 1,000 lines by default
    assert logs.returncode == 0 and logs.stdout.splitlines()[-1] == "hello from 0,1"
    assert len(logs.stdout.splitlines()) == 1000
    whole = cli(fleet, "logs", job_id, "--all")
    assert whole.stdout.splitlines()[0] == "line 0" and len(whole.stdout.splitlines()) == 1501
    status = json.loads(cli(fleet, "status", job_id, "--output", "json").stdout)
    assert status["status"] == "SUCCEEDED" and status["attempts"][0]["gpu_ids"] == [0, 1]
    listed = cli(fleet, "list", "--output", "json")
    assert job_id in listed.stdout
    other = cli(fleet, "status", job_id, team="nlp")
    assert other.returncode == 2 and "Traceback" not in other.stderr


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_why_explains_a_waiting_job_and_submit_rejects_what_never_fits(fleet: Fleet) -> None:
    fleet.start_agent("a1", gpus="2xA100-40GB")
    blocker = fleet.submit(
        {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "gpu_count": 2}
    )
    fleet.wait_status(blocker, {"RUNNING"})
    waiting = fleet.submit({"command": ["true"], "gpu_count": 1})
    fleet.wait_for(
        lambda: fleet.job(waiting)["pending_reason"]["code"] != "queued", 10, "a scheduler reason"
    )
    why = cli(fleet, "why", waiting, "--output", "json")
    assert why.returncode == 0, why.stderr
    reason = json.loads(why.stdout)
    reason = reason.get("pending_reason", reason)
    assert reason["code"] != "queued" and reason["message"]
    assert fleet.job(waiting)["pending_reason"]["position"] == 1
    events = fleet.get(f"/v1/jobs/{waiting}/events")["items"]
    assert any(e["kind"] == "waiting" and e["details"]["code"] == reason["code"] for e in events)
    bad = cli(fleet, "submit", "--gpus", "4", "--", "true")
    assert bad.returncode == 2 and "gpu_count" in bad.stderr and "Traceback" not in bad.stderr
    assert cli(fleet, "cancel", blocker).returncode == 0
    assert fleet.wait_status(blocker, {"CANCELLED"})["status"] == "CANCELLED"
    assert fleet.wait_status(waiting, {"SUCCEEDED"})["status"] == "SUCCEEDED"


def test_readme_demo_command_passes(tmp_path: Path) -> None:
    """`gpufleet demo` (what `make demo` runs): all SUCCEEDED, manifests verified, logs shown."""
    done = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "demo", "--data-dir", str(tmp_path)],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "demo passed" in done.stdout
    assert done.stdout.count("SUCCEEDED  manifest: ok") == 6
    assert "final test_acc=" in done.stdout
    assert "0 violations" in done.stdout
