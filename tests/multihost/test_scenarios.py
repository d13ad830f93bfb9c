"""Scenarios on a fleet spread over network-namespace hosts (tests/multihost/fleet.py): every
call crosses a real network between hosts, through haproxy, to two API servers and two
controllers on PostgreSQL, Redis and an S3 server of their own."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.fleet import BUCKET, MultiHostFleet

# the module's fleet starts in the first test's setup (about 80 s on a loaded 2-core machine)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED", "DEPENDENCY_FAILED"}

ARTIFACTS = r"""
import hashlib, os
out = os.environ["GPUFLEET_ARTIFACTS_DIR"]
os.makedirs(os.path.join(out, "eval"), exist_ok=True)
files = {"model.bin": os.urandom(300_000), "eval/metrics.json": b'{"acc": 0.97}\n'}
for name, data in files.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
    print("SHA", name, hashlib.sha256(data).hexdigest(), flush=True)
"""


def _s3(fleet: MultiHostFleet) -> Any:
    import boto3

    env = fleet._env(fleet.host_dir("client"))
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )


def _logs(fleet: MultiHostFleet, job_id: str, rank: int | None = None) -> str:
    args = ["logs", job_id, *(["--rank", str(rank)] if rank is not None else [])]
    return fleet.cli(*args).stdout


def test_a_job_through_s3_and_its_artifacts_verified_from_the_client_host(
    mh_fleet: MultiHostFleet,
) -> None:
    fleet = mh_fleet
    job_id = fleet.cli(
        "submit", "-q", "--gpus", "1", "--name", "s3-artifacts", "--workdir", "-", "--",
        sys.executable, "-c", ARTIFACTS,
    ).stdout.strip()  # fmt: skip
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=90)
    assert job["status"] == "SUCCEEDED", job
    expected = {
        line.split()[1]: line.split()[2]
        for line in _logs(fleet, job_id).splitlines()
        if line.startswith("SHA ")
    }
    assert set(expected) == {"model.bin", "eval/metrics.json"}

    # the objects are in the S3 server, under the attempt's prefix
    run_id = job["attempts"][-1]["run_id"]
    prefix = f"fleet/jobs/{job_id}/attempts/{run_id}/"
    keys = fleet.net.call_in(
        "client",
        lambda: [
            o["Key"]
            for o in _s3(fleet).list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        ],
    )
    assert any(k.endswith("artifacts/model.bin") for k in keys), keys
    assert any(k.endswith("MANIFEST.json") for k in keys), keys

    # the CLI on the client host (no object-store credentials) downloads through the API and
    # checks every size and sha256 against the accepted manifest
    with tempfile.TemporaryDirectory(prefix="gfmh-dl-") as tmp:
        dest = Path(tmp) / "out"
        fleet.cli("artifacts", job_id, "--download", str(dest))
        got = {
            str(p.relative_to(dest)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in dest.rglob("*")
            if p.is_file()
        }
        assert got == expected

        # an object changed in the store after the manifest was accepted is refused
        model_key = next(k for k in keys if k.endswith("artifacts/model.bin"))
        fleet.net.call_in(
            "client",
            lambda: _s3(fleet).put_object(Bucket=BUCKET, Key=model_key, Body=os.urandom(300_000)),
        )
        bad = Path(tmp) / "bad"
        r = fleet.cli("artifacts", job_id, "--download", str(bad), check=False)
        assert r.returncode == 1, r.stdout + r.stderr
        assert not (bad / "model.bin").exists()


GANG = r"""
import os, socket, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
print(f"ENV RANK={rank} MASTER_ADDR={addr} MASTER_PORT={port}", flush=True)
if rank == 0:
    srv = socket.create_server((addr, port))   # MASTER_ADDR must be this host's own address
    srv.settimeout(60)
    for _ in range(world - 1):
        conn, peer = srv.accept()
        print(f"rank 0 heard {conn.recv(64).decode()} from {peer[0]}", flush=True)
        conn.close()
else:
    for _ in range(300):
        try:
            conn = socket.create_connection((addr, port), timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    conn.sendall(f"rank{rank}".encode())
    conn.close()
    print(f"rank {rank} reached {addr}:{port}", flush=True)
"""


def test_a_two_node_gang_meets_at_rank_0s_host_address(mh_fleet: MultiHostFleet) -> None:
    fleet = mh_fleet
    job_id = fleet.submit(
        {
            "command": [sys.executable, "-c", GANG],
            "nodes": 2,
            "gpus_per_node": 4,
        }
    )
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=120)
    assert job["status"] == "SUCCEEDED", job
    members = {m["rank"]: m for m in job["attempts"]}
    assert set(members) == {0, 1}
    host0, host1 = (fleet.node_host(members[r]["node_id"]) for r in (0, 1))
    assert host0 != host1
    env0, env1 = (
        next(line for line in _logs(fleet, job_id, r).splitlines() if line.startswith("ENV "))
        for r in (0, 1)
    )
    for env in (env0, env1):
        assert f"MASTER_ADDR={fleet.addr(host0)} " in env, (env, fleet.addr(host0))
    assert f"rank 0 heard rank1 from {fleet.addr(host1)}" in _logs(fleet, job_id, 0)
    nodes = fleet.nodes()
    assert all(nodes[h]["available_gpus"] == 4 for h in fleet.gpu_hosts), nodes


SLEEPER = r"""
import sys, time
open(sys.argv[1], "w").write("started")
time.sleep(600)
"""


def _running(marker: str, attempt: int) -> bool:
    """Whether attempt ``attempt`` of the job whose command line holds ``marker`` runs on this
    machine, in any host namespace (found by /proc: a job in a PID namespace of its own
    cannot name its pid as the machine sees it)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() not in (proc / "cmdline").read_bytes():
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if f"GPUFLEET_ATTEMPT={attempt}".encode() in env and state != "Z":
            return True
    return False


def test_an_agent_cut_off_past_the_fence_timeout_is_fenced_and_rejoins_clean(
    mh_fleet: MultiHostFleet,
) -> None:
    """The GPU host's link goes down (its agent and job keep running, unheard): after the
    fence timeout the node is fenced and the job re-placed on another host under a higher
    token; when the link comes back the agent stops the fenced attempt, its GPUs are offered
    again and the node is HEALTHY, with no invariant broken."""
    fleet = mh_fleet
    fence_s = float(fleet.settings["GPUFLEET_FENCE_TIMEOUT_S"])
    pids = fleet.workdir / "pids"
    pids.mkdir(exist_ok=True)
    pids.chmod(0o777)
    marker = f"gfmh-sleeper-{uuid.uuid4().hex}"
    pidfile = pids / marker
    job_id = fleet.submit(
        {
            "command": [sys.executable, "-c", SLEEPER, str(pidfile), marker],
            "gpu_count": 2,
        }
    )
    first = fleet.wait_status(job_id, {"RUNNING"}, timeout_s=60)["attempts"][0]
    cut = fleet.node_host(first["node_id"])
    fleet.wait_for(pidfile.exists, 20, "the job to start")
    assert _running(marker, 1)

    fleet.cut(cut)
    cut_at = time.monotonic()
    try:

        def replaced() -> bool:
            job = fleet.job(job_id)
            last = job["attempts"][-1]
            return len(job["attempts"]) == 2 and last["status"] == "RUNNING"

        fleet.wait_for(replaced, fence_s + 60, "the job to be re-placed on another host")
        elapsed = time.monotonic() - cut_at
        job = fleet.job(job_id)
        old, new = job["attempts"]
        assert old["status"] == "FENCED" and old["node_id"] == cut
        assert new["node_id"] != cut and new["token"] > old["token"]
        assert elapsed >= fence_s - 1, f"fenced {elapsed:.1f} s after the cut"
        assert fleet.nodes()[cut]["status"] in {"QUARANTINED", "FENCED"}
        assert _running(marker, 1), "the cut-off host's job runs on, unheard"
        assert new["attempt"] == 2
    finally:
        fleet.restore(cut)

    # back on the network: the agent stops the fenced attempt, then its GPUs come back
    fleet.wait_for(lambda: not _running(marker, 1), 90, "the fenced attempt to be stopped")
    assert _running(marker, 2)
    fleet.wait_for(
        lambda: (
            fleet.nodes()[cut]["status"] == "HEALTHY" and fleet.nodes()[cut]["available_gpus"] == 4
        ),
        60,
        f"{cut} to be HEALTHY with its 4 GPUs",
        log=f"agent-{cut}",
    )
    assert fleet.job(job_id)["status"] == "RUNNING"  # the re-placed attempt is untouched
    check = fleet.admin_check()
    assert check.returncode == 0, check.stdout + check.stderr

    fleet.cli("cancel", job_id)
    assert fleet.wait_status(job_id, TERMINAL, timeout_s=60)["status"] == "CANCELLED"
    fleet.wait_for(
        lambda: all(n["available_gpus"] == 4 for n in fleet.nodes().values()),
        30,
        "every GPU free again",
    )


def test_prometheus_on_another_host_reaches_every_metrics_endpoint(
    mh_fleet: MultiHostFleet,
) -> None:
    """deploy/prometheus/prometheus.yml's targets, scraped from the client host: each API
    server's /metrics on 8420, each controller on 9421 (exactly one says it leads), each agent
    on 9430."""
    from tests.multihost.fleet import AGENT_METRICS_PORT, API_PORT, CTL_METRICS_PORT

    fleet = mh_fleet

    def scrape(host: str, port: int) -> str:
        import httpx

        return httpx.get(f"http://{fleet.addr(host)}:{port}/metrics", timeout=10).text

    for api in ("api-1", "api-2"):
        assert "gpufleet_api" in fleet.net.call_in("client", scrape, api, API_PORT)
    leaders = []
    for ctl in ("ctl-1", "ctl-2"):
        text = fleet.net.call_in("client", scrape, ctl, CTL_METRICS_PORT)
        line = next(x for x in text.splitlines() if x.startswith("gpufleet_leader "))
        leaders.append(float(line.split()[1]))
    assert sorted(leaders) == [0.0, 1.0], leaders
    assert fleet.leader() == f"controller-{leaders.index(1.0) + 1}"
    for gpu in fleet.gpu_hosts:
        assert "gpufleet_agent" in fleet.net.call_in("client", scrape, gpu, AGENT_METRICS_PORT)
