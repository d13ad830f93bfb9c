"""One object store per fleet: an agent whose store is not the fleet's, or cannot be written,
never registers (it exits 5 with one line) and gets no work, while the right one runs jobs;
with an S3 store (moto's S3 server on loopback, the AWS_* variables) logs and manifests go
through S3 end to end. Real agent processes, real jobs."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import TERMINAL, Fleet
from tests.ports import free_port

pytestmark = pytest.mark.slow


def _exit_of(fleet: Fleet, node_id: str, timeout_s: float = 60) -> tuple[int, list[str]]:
    """The agent's exit status and the ``error:`` lines of its log. An agent that has not
    exited within ``timeout_s`` stays in ``fleet.agents`` (TimeoutExpired), so that
    ``fleet.stop()`` stops it."""
    rc = fleet.agents[node_id].wait(timeout=timeout_s)
    del fleet.agents[node_id]
    log = (fleet.tmp / f"agent-{node_id}.log").read_text(errors="replace")
    return rc, [ln for ln in log.splitlines() if ln.startswith("error:")]


def _nodes(fleet: Fleet) -> dict[str, str]:
    return {n["node_id"]: n["status"] for n in fleet.get("/v1/nodes")["items"]}


def _logs(fleet: Fleet, job_id: str) -> str:
    with fleet.http() as c:
        r = c.get(f"/v1/jobs/{job_id}/logs")
        assert r.status_code == 200, r.text
        return r.text


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_an_agent_on_another_or_an_unwritable_store_is_refused_and_gets_no_work(
    fleet: Fleet,
) -> None:
    fleet_url = fleet.settings.resolved_object_store_url()
    other = fleet.tmp / "other-objects"
    fleet.start_agent("other", wait=False, env={"GPUFLEET_OBJECT_STORE_URL": f"file://{other}"})
    blocker = fleet.tmp / "a-file"
    blocker.write_text("not a directory")
    fleet.start_agent(
        "unwritable", wait=False, env={"GPUFLEET_OBJECT_STORE_URL": f"file://{blocker}/objects"}
    )

    rc, errors = _exit_of(fleet, "other")
    assert rc == 5, errors
    assert len(errors) == 1, errors
    assert "object store mismatch" in errors[0]
    assert f"file://{other}" in errors[0] and f"uses {fleet_url}" in errors[0], errors
    rc, errors = _exit_of(fleet, "unwritable")
    assert rc == 5, errors
    assert len(errors) == 1 and f"file://{blocker}/objects" in errors[0], errors
    assert "cannot be written and read back" in errors[0] and "NotADirectoryError" in errors[0]
    assert _nodes(fleet) == {}  # neither was ever registered

    fleet.start_agent("good", gpus="2xH100-80GB")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    jobs = [
        fleet.submit({"command": [sys.executable, "-c", f"print('out {i}')", marker]})
        for i in range(3)
    ]
    for i, job_id in enumerate(jobs):
        got = fleet.wait_status(job_id, TERMINAL, timeout_s=90)
        assert got["status"] == "SUCCEEDED", got
        assert {a["node_id"] for a in got["attempts"]} == {"good"}
        assert f"out {i}" in _logs(fleet, job_id)
    assert set(_nodes(fleet)) == {"good"}
    # the probe object lives under the reserved prefix of the fleet's store
    root = Path(fleet_url.removeprefix("file://"))
    assert (root / "_gpufleet" / "probe" / "good").is_file()
    assert (other / "_gpufleet" / "probe" / "other").is_file()  # it did write its own store
    assert not (other / "jobs").exists()  # but never got a job
    assert fleet.check() == []


# --- S3 through moto's server ------------------------------------------------------------

BUCKET = "gpufleet-test"


@contextlib.contextmanager
def _moto_server(tmp_path: Path, name: str = "moto") -> Iterator[str]:
    """One moto S3 server on a loopback port (its log in ``tmp_path/{name}.log``) with
    bucket ``BUCKET``. Yields its endpoint URL."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    assert exe is not None, "moto_server not installed (the dev extra installs moto[server])"
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=open(log, "ab"),  # noqa: SIM115 - owned by the child
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=_CREDS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_CREDS["AWS_SECRET_ACCESS_KEY"],
            region_name=_CREDS["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


_CREDS = {
    "AWS_ACCESS_KEY_ID": "gpufleet-test-key",
    "AWS_SECRET_ACCESS_KEY": "gpufleet-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """moto's S3 server on a loopback port; the AWS_* variables name it for this process and
    the agents it starts (inherited environment). Yields the endpoint URL."""
    with _moto_server(tmp_path) as endpoint:
        for key, value in {"AWS_ENDPOINT_URL": endpoint, **_CREDS}.items():
            monkeypatch.setenv(key, value)
        yield endpoint


def test_logs_and_manifests_go_through_s3_end_to_end(s3: str, tmp_path: Path) -> None:
    import boto3

    url = f"s3://{BUCKET}/fleet"
    fleet = Fleet(tmp_path, object_store_url=url).start()
    try:
        fleet.start_agent("s3-node", gpus="2xH100-80GB")
        marker = f"gpufleet-test-marker-{tmp_path.name}"
        code = (
            "import os, pathlib; print('hello from s3'); "
            "pathlib.Path(os.environ['GPUFLEET_ARTIFACTS_DIR'], 'model.txt').write_text('w')"
        )
        job_id = fleet.submit({"command": [sys.executable, "-c", code, marker]})
        got = fleet.wait_status(job_id, TERMINAL, timeout_s=120)
        assert got["status"] == "SUCCEEDED", got
        assert "hello from s3" in _logs(fleet, job_id)
        with fleet.http() as c:
            art = c.get(f"/v1/jobs/{job_id}/artifacts/model.txt")
            assert art.status_code == 200 and art.content == b"w", art.text

        keys = {
            o["Key"]
            for o in boto3.client("s3", endpoint_url=s3)
            .list_objects_v2(Bucket=BUCKET, Prefix="fleet/")
            .get("Contents", [])
        }
        run_id = got["attempts"][0]["run_id"]
        prefix = f"fleet/jobs/{job_id}/attempts/{run_id}"
        assert f"{prefix}/MANIFEST.json" in keys, keys
        assert f"{prefix}/logs/output.log" in keys, keys
        assert f"{prefix}/artifacts/model.txt" in keys, keys
        assert "fleet/_gpufleet/probe/s3-node" in keys
        assert not (tmp_path / "objects" / "jobs").exists()  # nothing went to a local dir

        # the same bucket under another prefix is another store: refused
        fleet.start_agent(
            "elsewhere", wait=False, env={"GPUFLEET_OBJECT_STORE_URL": f"s3://{BUCKET}/other"}
        )
        rc, errors = _exit_of(fleet, "elsewhere")
        assert rc == 5 and len(errors) == 1, errors
        assert f"s3://{BUCKET}/other" in errors[0] and f"uses {url}" in errors[0], errors
        # the right URL but an endpoint that does not answer: the probe fails, no registration
        fleet.start_agent(
            "noendpoint",
            wait=False,
            env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
        )
        rc, errors = _exit_of(fleet, "noendpoint", timeout_s=120)
        assert rc == 5 and len(errors) == 1 and url in errors[0], errors
        assert set(_nodes(fleet)) == {"s3-node"}
    finally:
        fleet.stop()


def test_an_agent_on_another_s3_server_with_the_same_bucket_is_refused(
    s3: str, tmp_path: Path
) -> None:
    """The same URL (``s3://bucket/fleet``), another store: ``AWS_ENDPOINT_URL`` names a second
    S3 server that has a bucket of the same name. The agent's own probe succeeds there; the
    controller does not find the agent's probe object in its store and refuses the node,
    which exits 5 and gets no work; the agent on the fleet's server runs the jobs."""
    import boto3

    url = f"s3://{BUCKET}/fleet"
    with _moto_server(tmp_path, "moto-other") as other:
        fleet = Fleet(tmp_path, object_store_url=url).start()
        try:
            fleet.start_agent("elsewhere", wait=False, env={"AWS_ENDPOINT_URL": other})
            rc, errors = _exit_of(fleet, "elsewhere", timeout_s=40)  # seconds alone
            assert rc == 5, errors
            assert errors == [
                "error: the controller cannot read this agent's probe object at "
                f"{url}/_gpufleet/probe/elsewhere: the agent and the controller use different "
                "object stores (check AWS_ENDPOINT_URL / credentials)"
            ], errors
            assert _nodes(fleet) == {}  # never registered: the scheduler never saw it

            fleet.start_agent("right", gpus="2xH100-80GB")
            marker = f"gpufleet-test-marker-{tmp_path.name}"
            jobs = [
                fleet.submit({"command": [sys.executable, "-c", f"print('s3 {i}')", marker]})
                for i in range(2)
            ]
            for i, job_id in enumerate(jobs):
                got = fleet.wait_status(job_id, TERMINAL, timeout_s=120)
                assert got["status"] == "SUCCEEDED", got
                assert {a["node_id"] for a in got["attempts"]} == {"right"}
                assert f"s3 {i}" in _logs(fleet, job_id)
            assert set(_nodes(fleet)) == {"right"}

            def keys(endpoint: str) -> set[str]:
                listed = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(
                    Bucket=BUCKET, Prefix="fleet/"
                )
                return {o["Key"] for o in listed.get("Contents", [])}

            # the refused agent did write its probe, to the other server, and nothing else
            assert keys(other) == {"fleet/_gpufleet/probe/elsewhere"}
            ours = keys(s3)
            assert "fleet/_gpufleet/probe/right" in ours
            assert "fleet/_gpufleet/probe/elsewhere" not in ours
            assert fleet.check() == []
        finally:
            fleet.stop()
