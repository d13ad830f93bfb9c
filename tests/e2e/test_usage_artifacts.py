"""Accounting and artifacts with real agents and real job processes: usage records of real
attempts match their reservation-to-end times; artifacts are listed from the accepted
manifest, downloaded and verified by the CLI, and nothing outside the manifest is served."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow

WRITE = (
    "import os, pathlib; d = pathlib.Path(os.environ['GPUFLEET_ARTIFACTS_DIR']);"
    " (d / 'sub').mkdir(parents=True, exist_ok=True);"
    " (d / 'model.bin').write_bytes(bytes(range(256)) * 4096);"
    " (d / 'sub' / 'notes.txt').write_text('hello artifacts')"
)


def cli(fleet: Fleet, *args: str, team: str = "vision") -> subprocess.CompletedProcess[str]:
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
        timeout=120,
        check=False,
    )


def _t(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_real_attempts_are_accounted_and_artifacts_verified(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_agent("a1")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    art = fleet.submit({"command": [sys.executable, "-c", WRITE, marker], "gpu_count": 2})
    jobs = [
        ("vision", art),
        ("vision", fleet.submit({"command": [sys.executable, "-c", "pass", marker]})),
        (
            "nlp",
            fleet.submit(
                {"command": [sys.executable, "-c", "raise SystemExit(3)", marker], "gpu_count": 4},
                "nlp",
            ),
        ),
        ("nlp", fleet.submit({"command": ["/bin/sleep", "0.5"], "gpu_count": 8}, "nlp")),
    ]
    want: dict[str, float] = {"vision": 0.0, "nlp": 0.0}
    for team, job_id in jobs:
        got = fleet.wait_status(job_id, TERMINAL, timeout_s=90, team=team)
        for a in got["attempts"]:
            span = (_t(a["finished_at"]) - _t(a["created_at"])).total_seconds()
            want[team] += span * len(a["gpu_ids"])
    for team in ("vision", "nlp"):
        usage = fleet.get("/v1/usage", team)
        assert [ln["key"] for ln in usage["items"]] == [team]
        assert abs(usage["total_gpu_seconds"] - want[team]) < 1.0, (usage, want)

    # artifacts: listed from the accepted manifest, downloaded and verified by the CLI
    listed = cli(fleet, "artifacts", art, "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert "model.bin" in listed.stdout and "sub/notes.txt" in listed.stdout
    dest = tmp_path / "out"
    got = cli(fleet, "artifacts", art, "--download", str(dest))
    assert got.returncode == 0, got.stderr
    assert (dest / "model.bin").read_bytes() == bytes(range(256)) * 4096
    assert (dest / "sub" / "notes.txt").read_text() == "hello artifacts"

    with fleet.http() as http:
        resp = http.get(f"/v1/jobs/{art}/artifacts/model.bin")
        assert resp.status_code == 200
        digest = hashlib.sha256(resp.content).hexdigest()
        assert resp.headers["x-gpufleet-sha256"] == digest
        # only what the manifest lists: no other object of the attempt, no traversal
        for path in ("logs/output.log", "../MANIFEST.json", "..%2F..%2FMANIFEST.json", "nope"):
            bad = http.get(f"/v1/jobs/{art}/artifacts/{path}")
            assert bad.status_code == 404, (path, bad.status_code)
    with fleet.http("nlp") as http:
        assert http.get(f"/v1/jobs/{art}/artifacts").status_code == 404  # another team's
        failed = http.get(f"/v1/jobs/{jobs[2][1]}/artifacts")
        assert failed.status_code == 409 and failed.json()["field"] == "job_id"

    # a stored object changed after acceptance is never delivered whole
    store_root = Path(fleet.settings.resolved_object_store_url().removeprefix("file://"))
    (victim,) = store_root.glob(f"jobs/{art}/attempts/*/artifacts/model.bin")
    victim.write_bytes(b"\0" * victim.stat().st_size)
    broken = cli(fleet, "artifacts", art, "--download", str(tmp_path / "again"))
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert not (tmp_path / "again" / "model.bin").exists()
    with fleet.http() as http, pytest.raises(httpx.HTTPError):
        http.get(f"/v1/jobs/{art}/artifacts/model.bin")


JOB_S = 6.0
AWAY_S = 16.0


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_an_exit_while_the_controller_is_away_is_accounted_at_the_exit(fleet: Fleet) -> None:
    """Issue 24, item 12: a 2-GPU job of ``JOB_S`` exits while the controller is stopped;
    the controller is back ``AWAY_S`` after the job started, and the agent's report arrives
    then. The usage record ends at the exit (the agent's clock at the exit and at the send,
    their difference taken off the receipt): about 2 x ``JOB_S`` GPU-seconds, not 2 x
    ``AWAY_S``."""
    from gpufleet.controller.main import Controller
    from gpufleet.queue import InProcWaker

    fleet.start_agent("a1")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    job = fleet.submit(
        {
            "command": [sys.executable, "-c", f"import time; time.sleep({JOB_S})", marker],
            "gpu_count": 2,
        }
    )
    fleet.wait_status(job, {"RUNNING"})
    started = time.monotonic()
    fleet.controller.stop()  # away when the job exits
    time.sleep(max(0.0, AWAY_S - (time.monotonic() - started)))
    fleet.controller = Controller(fleet.settings, fleet.db, InProcWaker())
    fleet.controller.start()
    done = fleet.wait_status(job, TERMINAL, timeout_s=60)
    assert done["status"] == "SUCCEEDED", done
    [attempt] = done["attempts"]
    span = (_t(attempt["finished_at"]) - _t(attempt["created_at"])).total_seconds()
    used = fleet.get("/v1/usage")["total_gpu_seconds"]
    assert 2 * JOB_S <= used <= 2 * (JOB_S + 3.0), (used, attempt)
    assert abs(used - 2 * span) < 0.1, (used, span)
    assert (_t(done["finished_at"]) - _t(attempt["finished_at"])).total_seconds() > 5.0
