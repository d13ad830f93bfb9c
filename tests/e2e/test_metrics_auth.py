"""The controller's and the agent's metrics ports (real ``gpufleet controller`` and
``gpufleet agent`` processes): bound to loopback by default, and with
``GPUFLEET_METRICS_BASIC_AUTH`` set, a scrape without (or with wrong) credentials gets 401
and no metric, one with them gets the metrics."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gpufleet.metrics_http import BasicAuth, parse_basic_auth
from tests.e2e.harness import Fleet
from tests.ports import free_port

pytestmark = pytest.mark.slow


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _wait_scrape(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        try:
            return httpx.get(url, headers=headers, timeout=5)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _listen_addresses(port: int) -> set[str]:
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


def test_parse_basic_auth_forms(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"s3cret").hexdigest()
    assert parse_basic_auth(f"prom:sha256:{digest}") == BasicAuth("prom", digest)
    (tmp_path / "pw").write_text("s3cret\n")
    assert parse_basic_auth(f"prom:file:{tmp_path / 'pw'}") == BasicAuth("prom", digest)
    assert parse_basic_auth("prom:s3cret") == BasicAuth("prom", digest)
    for bad in ("prom", ":x", "prom:", "prom:sha256:XYZ", f"prom:file:{tmp_path / 'none'}"):
        with pytest.raises(ValueError, match="metrics basic auth"):
            parse_basic_auth(bad)
    auth = parse_basic_auth("prom:s3cret")
    assert auth.allows(_basic("prom", "s3cret")["Authorization"])
    assert not auth.allows(_basic("prom", "wrong")["Authorization"])
    assert not auth.allows(_basic("other", "s3cret")["Authorization"])
    assert not auth.allows("Basic !!!") and not auth.allows(None) and not auth.allows("Bearer x")


def test_controller_and_agent_metrics_need_basic_auth(fleet: Fleet) -> None:
    password_file = fleet.tmp / "metrics.pass"
    password_file.write_text("scrape-me\n")
    auth_env = {"GPUFLEET_METRICS_BASIC_AUTH": f"prometheus:file:{password_file}"}
    agent_port, ctl_port = free_port(), free_port()
    fleet.start_agent(
        "n1", gpus="1xA100-40GB", env=auth_env, args=("--metrics-port", str(agent_port))
    )
    ctl_log = open(fleet.tmp / "controller-metrics.log", "ab")  # noqa: SIM115
    env = dict(
        os.environ,
        **auth_env,
        GPUFLEET_DATA_DIR=str(fleet.tmp),
        GPUFLEET_DATABASE_URL=fleet.settings.resolved_database_url(),
        GPUFLEET_CONTROLLER_METRICS_PORT=str(ctl_port),
    )
    ctl = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "controller",
            "--address",
            f"127.0.0.1:{free_port()}",
            "--join-address",
            f"127.0.0.1:{free_port()}",
        ],
        env=env,
        stdout=ctl_log,
        stderr=subprocess.STDOUT,
    )
    try:
        for port, series in ((agent_port, "gpufleet_agent_info"), (ctl_port, "gpufleet_")):
            url = f"http://127.0.0.1:{port}/metrics"
            anonymous = _wait_scrape(url)
            assert anonymous.status_code == 401, anonymous.text
            assert "gpufleet_" not in anonymous.text
            assert anonymous.headers["WWW-Authenticate"].startswith("Basic")
            wrong = httpx.get(url, headers=_basic("prometheus", "guess"), timeout=5)
            assert wrong.status_code == 401
            ok = httpx.get(url, headers=_basic("prometheus", "scrape-me"), timeout=5)
            assert ok.status_code == 200 and series in ok.text, ok.text[:500]
            assert _listen_addresses(port) == {"127.0.0.1"}  # the default: loopback only
    finally:
        ctl.terminate()
        ctl.wait(timeout=30)
        ctl_log.close()


def test_a_malformed_metrics_auth_setting_stops_the_controller(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        GPUFLEET_DATA_DIR=str(tmp_path),
        GPUFLEET_METRICS_BASIC_AUTH="prometheus:sha256:not-hex",
    )
    r = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "controller", "--metrics-port", "9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "GPUFLEET_METRICS_BASIC_AUTH" in r.stderr, r.stderr
