"""``admin node fence --confirm-dead`` on a node whose real agent is heartbeating: refused
(CLI exit 1 naming when the node was last heard from; REST 409, field ``force``), nothing
fenced or released, the job keeps running; once the agent is stopped and the heartbeat
window has passed, the same command fences it; ``--force`` overrides the check."""

from __future__ import annotations

import sys
import time

import pytest
from sqlalchemy import select

from gpufleet.store.tables import ReservationRow
from tests.e2e.harness import Fleet
from tests.e2e.test_recovery import admin_env, gpufleet_cli

pytestmark = pytest.mark.slow


def _reservations(fleet: Fleet, node_id: str) -> list[str]:
    with fleet.db.read() as s:
        return sorted(
            s.scalars(select(ReservationRow.status).where(ReservationRow.node_id == node_id))
        )


def test_fence_confirm_dead_refuses_a_node_that_is_heartbeating(fleet: Fleet) -> None:
    fleet.start_agent("n1", gpus="2xH100-80GB")
    fleet.start_agent("n2", gpus="2xH100-80GB")
    # the marker: Fleet.stop() kills the job, which outlives the agent killed below
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    job = fleet.submit({"command": sleeper, "gpu_count": 2, "gpu_type": "H100"})
    fleet.wait_status(job, {"RUNNING"})
    node = fleet.job(job)["attempts"][-1]["node_id"]
    other = "n2" if node == "n1" else "n1"
    before = _reservations(fleet, node)

    r = gpufleet_cli(fleet, "admin", "node", "fence", node, "--confirm-dead")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "was last heard from" in r.stderr and "looks alive" in r.stderr, r.stderr
    assert "--force" in r.stderr
    env = admin_env(fleet)
    with fleet.http() as c:
        rest = c.post(
            f"/v1/admin/nodes/{node}/fence",
            json={"confirm_dead": True},
            headers={"Authorization": f"Bearer {env['GPUFLEET_TOKEN']}"},
        )
    assert rest.status_code == 409, rest.text
    assert rest.json()["field"] == "force"
    assert fleet.node(node)["status"] == "HEALTHY"
    assert fleet.job(job)["status"] == "RUNNING"
    assert len(fleet.job(job)["attempts"]) == 1
    assert _reservations(fleet, node) == before

    # --force: the operator overrides the check (the other node, heartbeating too)
    forced = gpufleet_cli(fleet, "admin", "node", "fence", other, "--confirm-dead", "--force")
    assert forced.returncode == 0, forced.stderr
    assert fleet.node(other)["status"] == "FENCED"

    # the agent stops; after the heartbeat window the node is fenced without --force
    fleet.kill_agent(node)
    time.sleep(fleet.settings.heartbeat_interval_s * fleet.settings.suspect_after_missed + 0.5)
    done = gpufleet_cli(fleet, "admin", "node", "fence", node, "--confirm-dead")
    assert done.returncode == 0, done.stderr
    assert "FENCED" in done.stdout and "2 GPU(s) released" in done.stdout, done.stdout
