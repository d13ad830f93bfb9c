"""Daily CLI paths on a real platform (controller, API, a real agent, real job processes):
``submit --wait`` exits with the job's exit code and shows the log's end; ``logs -f`` on a
pending job waits and follows once it runs; the SDK's wait and logs on a job that ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.client import Client
from tests.e2e.harness import Fleet

pytestmark = pytest.mark.slow


def _env(fleet: Fleet) -> dict[str, str]:
    return dict(
        os.environ,
        GPUFLEET_URL=fleet.api.url,
        GPUFLEET_TOKEN=fleet.tokens["vision"],
        GPUFLEET_CONFIG=str(fleet.tmp / "none.yaml"),
    )


def _cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=_env(fleet),
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_wait_exit_code_log_tail_and_follow_of_a_pending_job(fleet: Fleet) -> None:
    # no agent yet: the job waits, and `logs -f` says so, then follows once it runs
    waiting = _cli(fleet, "submit", "-q", "--", "sh", "-c", "echo started; echo done").stdout
    job_id = waiting.strip()
    follower = subprocess.Popen(
        [sys.executable, "-m", "gpufleet.cli.main", "logs", "-f", job_id],
        env=_env(fleet),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stderr is not None
        assert f"job {job_id}: PENDING" in follower.stderr.readline()
        fleet.start_agent("a1")
        out, _ = follower.communicate(timeout=90)
        assert follower.returncode == 0
        assert out.splitlines() == ["started", "done"]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()

    script = "for i in $(seq 1 30); do echo line$i; done; exit 7"
    failed = _cli(fleet, "submit", "--wait", "--", "sh", "-c", script)
    assert failed.returncode == 7, failed.stderr
    tail = failed.stderr.split("log lines of", 1)[1].splitlines()[1:]
    assert tail == [f"line{i}" for i in range(11, 31)]  # the last 20 lines

    # a job's own status above 128 is its exit code; a death by signal N exits 128+N
    own = _cli(fleet, "submit", "--wait", "-q", "--", "sh", "-c", "exit 200")
    assert own.returncode == 200, own.stderr
    killed = _cli(fleet, "submit", "--wait", "-q", "--", "sh", "-c", "kill -KILL $$")
    assert killed.returncode == 137, killed.stderr

    ok = _cli(fleet, "submit", "--wait", "-q", "--", "true")
    assert ok.returncode == 0 and len(ok.stdout.split()) == 1 and ok.stderr == ""

    # --export: a named variable of the submitting shell, and one set on the command line
    exported = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "submit", "-q", "--wait", "--export",
         "LR,MODE=fast", "--", "sh", "-c", 'echo "lr=$LR mode=$MODE home=${HOME:-unset}"'],
        env=_env(fleet) | {"LR": "0.001"},
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    shown = _cli(fleet, "logs", exported.stdout.strip()).stdout
    assert shown.startswith("lr=0.001 mode=fast"), shown

    with Client(fleet.api.url, fleet.tokens["vision"]) as sdk:
        made = sdk.submit(["sh", "-c", "echo from-sdk; exit 3"], max_retries=0)
        done = sdk.wait(made, timeout_s=90, poll_s=0.2)
        assert (done.status, done.exit_code) == ("FAILED", 3)
        assert sdk.logs(done, tail=5) == "from-sdk\n"
        assert b"".join(sdk.iter_logs(made, follow=True)) == b"from-sdk\n"


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_the_readme_sdk_example_runs(fleet: Fleet) -> None:
    """The README's notebook example, pasted as is, against a real platform."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Python SDK", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    fleet.start_agent("a1")
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=_env(fleet),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SUCCEEDED 0 a1" in done.stdout
    assert "final test_acc=" in done.stdout
    assert "404 not_found" in done.stdout


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_a_running_job_shows_its_owner_run_time_and_time_left(fleet: Fleet) -> None:
    """Issue 26: list/status/the dashboard show how long a job has run and how much of its
    max runtime is left (the server's clock), and who submitted it."""
    import json
    import time

    import httpx

    fleet.start_agent("a1")
    job_id = _cli(
        fleet, "submit", "-q", "--max-runtime-s", "600", "--", "sleep", "60"
    ).stdout.strip()
    deadline = time.monotonic() + 90
    got: dict[str, object] = {}
    while time.monotonic() < deadline:
        got = json.loads(_cli(fleet, "status", job_id, "-o", "json").stdout)
        if got["status"] == "RUNNING" and (got.get("elapsed_s") or 0) >= 2:
            break
        time.sleep(0.5)
    assert got["status"] == "RUNNING", got
    elapsed, left = float(got["elapsed_s"]), float(got["time_left_s"])  # type: ignore[arg-type]
    assert 2 <= elapsed < 90 and abs(elapsed + left - 600) < 1, got
    assert got["owner"]  # the harness's token: no name, so its id is its user
    shown = _cli(fleet, "status", job_id).stdout
    assert "elapsed" in shown and "time left" in shown and "of 10m" in shown, shown
    row = next(line for line in _cli(fleet, "list").stdout.splitlines() if "RUNNING" in line)
    assert row.split()[-1].endswith("m") and row.split()[-2].endswith("s"), row
    page = httpx.get(
        f"{fleet.api.url}/ui/jobs/{job_id}", cookies={"gpufleet_token": fleet.tokens["vision"]}
    )
    assert page.status_code == 200
    assert 'id="job-time-left"' in page.text and 'id="job-owner"' in page.text, page.text[:2000]
    assert _cli(fleet, "cancel", job_id).returncode == 0
    deadline = time.monotonic() + 60  # a cancel is asynchronous: RUNNING until stopped
    while time.monotonic() < deadline:
        done = json.loads(_cli(fleet, "status", job_id, "-o", "json").stdout)
        if done["status"] != "RUNNING":
            break
        time.sleep(0.5)
    assert done["status"] != "RUNNING" and done["time_left_s"] is None, done
