"""``why --suggest`` against a real platform (API + controller + an agent, real processes),
on SQLite and PostgreSQL: a job waiting for 8 GPUs on a node with 4 free is told that 4 GPUs
start now on that node, and applying it with ``gpufleet update --gpus 4`` starts it."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufleet.cli.main import app as cli_app
from tests.e2e.harness import Fleet

pytestmark = pytest.mark.slow


def test_suggest_fewer_gpus_then_update_starts_it(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_URL", fleet.api.url)
    monkeypatch.setenv("GPUFLEET_TOKEN", fleet.tokens["vision"])
    monkeypatch.setenv("GPUFLEET_CONFIG", str(fleet.tmp / "absent.yaml"))

    def cli(*args: str) -> Any:
        result = CliRunner().invoke(cli_app, list(args))
        assert "Traceback" not in result.output, result.output
        return result

    fleet.start_agent("n7", gpus="8xH100-80GB")
    # the marker lets Fleet.stop kill the blocker's process (it would outlive the test)
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    sleep = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    blocker = fleet.submit({"command": sleep, "gpu_count": 4, "name": "blocker"})
    fleet.wait_status(blocker, {"RUNNING"}, 60)
    big = fleet.submit({"command": [sys.executable, "-c", "pass"], "gpu_count": 8, "name": "big"})
    # the scheduler has looked at it (a pass gave it a reason) and it still waits
    fleet.wait_for(lambda: fleet.job(big)["pending_reason"] is not None, 30, "a reason")
    assert fleet.job(big)["status"] == "PENDING"

    answer = fleet.get(f"/v1/jobs/{big}/suggestions")
    assert answer["starts_as_is"] is False
    first = answer["suggestions"][0]
    assert first["kind"] == "fewer_gpus"
    assert first["change"] == {"gpu_count": 4}
    assert first["node_ids"] == ["n7"]

    r = cli("why", big, "--suggest")
    assert r.exit_code == 0, r.output
    assert "4 GPUs would start now on n7" in r.output
    assert f"gpufleet update {big} --gpus 4" in r.output

    # GPUs change only while PENDING; a count no node holds is refused naming the field
    with fleet.http() as h:
        running = h.patch(f"/v1/jobs/{blocker}", json={"gpu_count": 2})
        assert running.status_code == 409, running.text
        assert running.json()["error"] == "job_not_pending"
        too_big = h.patch(f"/v1/jobs/{big}", json={"gpu_count": 16})
        assert too_big.status_code == 422, too_big.text
        assert too_big.json()["field"] == "gpu_count"

    r = cli("update", big, "--gpus", "4")
    assert r.exit_code == 0, r.output
    assert "gpus=4" in r.output
    done = fleet.wait_status(big, {"RUNNING", "SUCCEEDED"}, 30)
    assert done["gpu_count"] == 4
    assert len(done["attempts"][0]["gpu_ids"]) == 4
    events = fleet.get(f"/v1/jobs/{big}/events")["items"]
    assert any(e["kind"] == "patched" and "gpu_count" in (e["details"] or {}) for e in events)

    # a running job gets no suggestion, and says why
    answer = fleet.get(f"/v1/jobs/{blocker}/suggestions")
    assert answer["suggestions"] == [] and "RUNNING" in answer["none_reason"]
    with fleet.http() as h:
        assert h.delete(f"/v1/jobs/{blocker}").status_code in (200, 202)
    assert fleet.check() == []
