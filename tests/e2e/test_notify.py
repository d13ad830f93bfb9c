"""Completion webhooks through the whole platform: a job submitted with ``notify`` runs on
a real agent subprocess, and the API server's delivery worker (the one ``gpufleet up`` and
``gpufleet server`` run) POSTs its final record to an HTTP server in this test, signed with
the secret ``gpufleet notify secret`` prints; the team's default URLs set by an admin go to
a job submitted without ``notify``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpufleet.domain import webhooks
from gpufleet.services import auth
from tests.e2e.harness import Fleet
from tests.store.test_notify import Receiver

pytestmark = pytest.mark.slow

# the receiver listens on loopback: allowed by the setting, as an on-premises receiver is
fleet_settings = {"notify_allow_private": True, "notify_backoff_s": 0.2}


def cli(fleet: Fleet, token: str, *args: str) -> str:
    env = {**os.environ, "GPUFLEET_URL": fleet.api.url, "GPUFLEET_TOKEN": token}
    out = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_webhook_of_a_finished_job(fleet: Fleet) -> None:
    receiver = Receiver([500])  # the first delivery fails: retried
    try:
        fleet.start_agent("n1", gpus="2xH100-80GB")
        job_id = fleet.submit({"command": ["true"], "gpu_count": 1, "notify": [receiver.url]})
        fleet.wait_status(job_id, {"SUCCEEDED"}, timeout_s=60)
        fleet.wait_for(lambda: len(receiver.got) >= 2, 30, "the retried delivery")
        headers, body = receiver.got[-1]
        secret = cli(fleet, fleet.tokens["vision"], "notify", "secret").strip()
        assert webhooks.verify(
            secret, body, headers["x-gpufleet-signature"], headers["x-gpufleet-timestamp"]
        )
        record = json.loads(body)
        assert record["job_id"] == job_id and record["status"] == "SUCCEEDED"
        assert headers["x-gpufleet-delivery"] == job_id

        # rotation: a new secret, and another team's token may not read vision's
        rotated = cli(fleet, fleet.tokens["vision"], "notify", "secret", "--rotate").strip()
        assert rotated and rotated != secret
        with fleet.http("nlp") as c:
            assert c.get("/v1/teams/vision/notify-secret").status_code == 403

        # team defaults, set by an admin where team settings are set
        admin = fleet.db.run_write(lambda s: auth.create_token(s, "vision", is_admin=True))
        cli(fleet, admin, "admin", "team", "set", "nlp", "--notify", receiver.url)
        other = fleet.submit({"command": ["true"], "gpu_count": 1}, team="nlp")
        fleet.wait_status(other, {"SUCCEEDED"}, timeout_s=60, team="nlp")
        fleet.wait_for(
            lambda: any(h["x-gpufleet-delivery"] == other for h, _ in receiver.got),
            30,
            "the team default's delivery",
        )
        nlp_secret = cli(fleet, fleet.tokens["nlp"], "notify", "secret").strip()
        h, b = next((h, b) for h, b in receiver.got if h["x-gpufleet-delivery"] == other)
        assert webhooks.verify(nlp_secret, b, h["x-gpufleet-signature"], h["x-gpufleet-timestamp"])
    finally:
        receiver.close()
