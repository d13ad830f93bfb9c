"""Node topology labels end to end, on both databases: a real agent reports labels from
GPUFLEET_AGENT_LABELS and --label; an admin sets and removes labels with
``gpufleet admin node label`` (a real CLI process against the real API server); admin labels
survive the agent's restart and re-registration and win on a shared key; the scheduler's
snapshot sees the same labels as ``/v1/nodes``; bad keys are 4xx naming the field."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from gpufleet.services import auth
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from tests.e2e.harness import Fleet

pytestmark = pytest.mark.slow

AGENT_ENV = {"GPUFLEET_AGENT_LABELS": "rack=r1,switch=s1"}
AGENT_ARGS = ("--label", "switch=s3", "--label", "zone=z1")


def cli(fleet: Fleet, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env |= {"GPUFLEET_URL": fleet.api.url, "GPUFLEET_TOKEN": token, "COLUMNS": "250"}
    env["GPUFLEET_DATA_DIR"] = str(fleet.tmp / "cli-home")  # no client.yaml there
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def user_labels(fleet: Fleet, node_id: str) -> dict[str, str]:
    return {
        k: v for k, v in fleet.node(node_id)["labels"].items() if not k.startswith("gpufleet/")
    }


def test_agent_and_admin_labels(fleet: Fleet) -> None:
    admin = fleet.db.run_write(
        partial(auth.create_token, team_id="ops", is_admin=True, create_team_if_missing=True)
    )
    fleet.start_agent("lab-0", env=AGENT_ENV, args=AGENT_ARGS)
    # The env var's labels, with the flag winning on switch.
    assert user_labels(fleet, "lab-0") == {"rack": "r1", "switch": "s3", "zone": "z1"}

    got = cli(fleet, admin, "admin", "node", "label", "lab-0", "rack=r2", "pod=p1")
    assert got.returncode == 0, got.stderr
    assert "rack=r2" in got.stdout and "set by an admin: pod=p1, rack=r2" in got.stdout
    node = fleet.node("lab-0")
    assert node["admin_labels"] == {"rack": "r2", "pod": "p1"}
    assert user_labels(fleet, "lab-0") == {"rack": "r2", "switch": "s3", "zone": "z1", "pod": "p1"}

    # Bad input: the CLI and the API both name the field; a team token may not set labels.
    got = cli(fleet, admin, "admin", "node", "label", "lab-0", "bad key=x")
    assert got.returncode == 2
    assert "(field: labels.bad key)" in got.stderr
    with fleet.http("vision") as c:
        assert c.patch("/v1/admin/nodes/lab-0/labels", json={"labels": {}}).status_code == 403
    with fleet.http("vision") as c:
        c.headers["Authorization"] = f"Bearer {admin}"
        r = c.patch("/v1/admin/nodes/lab-0/labels", json={"labels": {"rack": "r 2"}})
        assert r.status_code == 422
        assert r.json()["field"] == "labels.rack"
        r = c.put("/v1/admin/nodes/lab-0/labels", json={"labels": {"gpufleet/containment": "x"}})
        assert (r.status_code, r.json()["field"]) == (422, "labels.gpufleet/containment")
        r = c.put("/v1/admin/nodes/nope/labels", json={"labels": {"rack": "r1"}})
        assert (r.status_code, r.json()["field"]) == (404, "node_id")
        r = c.put("/v1/admin/nodes/lab-0/labels", json={"labels": {"rack": 3}})
        assert r.status_code == 422 and "labels" in str(r.json()["field"])

    # The agent restarts (new epoch, registers again): the admin's labels stay and still win.
    epoch = fleet.node("lab-0")["agent_epoch"]
    fleet.kill_agent("lab-0", signal.SIGTERM)
    fleet.start_agent("lab-0", env=AGENT_ENV, args=AGENT_ARGS, wait=False)
    fleet.wait_for(
        lambda: (
            fleet.node("lab-0")["agent_epoch"] > epoch
            and fleet.node("lab-0")["status"] == "HEALTHY"
        ),
        30,
        "the agent's re-registration",
    )
    assert user_labels(fleet, "lab-0") == {"rack": "r2", "switch": "s3", "zone": "z1", "pod": "p1"}

    # Removing the admin's rack shows the agent's again; the snapshot agrees with /v1/nodes.
    got = cli(fleet, admin, "admin", "node", "label", "lab-0", "rack-")
    assert got.returncode == 0, got.stderr
    assert user_labels(fleet, "lab-0") == {"rack": "r1", "switch": "s3", "zone": "z1", "pod": "p1"}
    with fleet.db.read() as s:
        snap = load_snapshot(s, db_now(s))
    assert (
        dict(next(n for n in snap.nodes if n.node_id == "lab-0").labels)
        == (fleet.node("lab-0")["labels"])
    )
    table = cli(fleet, fleet.tokens["vision"], "nodes", "--wide")
    assert table.returncode == 0, table.stderr
    assert "rack=r1" in table.stdout and "pod=p1" in table.stdout

    # --replace (PUT): the admin's labels become exactly these.
    got = cli(
        fleet, admin, "admin", "node", "label", "lab-0", "--replace", "-o", "json", "rack=r3"
    )
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["admin_labels"] == {"rack": "r3"}
    assert user_labels(fleet, "lab-0") == {"rack": "r3", "switch": "s3", "zone": "z1"}


def test_agent_refuses_bad_labels(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env |= {"GPUFLEET_DATA_DIR": str(tmp_path), "GPUFLEET_AGENT_LABELS": "rack=r1,sw itch=s3"}
    got = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "agent", "--label", "zone=z1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert got.returncode == 2
    assert "GPUFLEET_AGENT_LABELS" in got.stderr and "use key=value" in got.stderr
