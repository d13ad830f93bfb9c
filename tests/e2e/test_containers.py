"""Acceptance of jobs with an ``image``: real controller, API and agents, jobs as podman
containers pulled from the local registry (``scripts/ensure-services.sh``; without the
engine these tests fail, they do not skip)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.agent.runtime.container import LABEL_RUN, ContainerEngine
from gpufleet.cli.output import phases_text
from gpufleet.domain.manifest import Manifest
from gpufleet.objectstore import ObjectStore
from tests.container_support import BUSYBOX, PYTHON, fresh_image
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow

JOB = (
    'echo "gpus=$CUDA_VISIBLE_DEVICES"; '
    'echo "$CUDA_VISIBLE_DEVICES" > "$GPUFLEET_ARTIFACTS_DIR/gpus.txt"; '
    "i=0; while [ $i -lt 500 ]; do echo line-$i; i=$((i+1)); done; echo the-end"
)


@pytest.fixture
def engine(tmp_path: Path) -> ContainerEngine:
    e = ContainerEngine("podman", state_dir=tmp_path / "engine-test")
    e.ensure_present(BUSYBOX)
    return e


def _manifest(fleet: Fleet, attempt: dict) -> tuple[ObjectStore, Manifest]:
    store = ObjectStore(fleet.settings.resolved_object_store_url())
    return store, Manifest.from_json(store.get_bytes(store.key_of(attempt["manifest_uri"])))


def test_image_job_runs_in_a_container_and_the_second_start_is_warm(
    fleet: Fleet, engine: ContainerEngine
) -> None:
    fleet.start_agent("a1", gpus="4xH100-80GB")
    fleet.get("/v1/nodes")
    image = fresh_image(engine)
    try:
        job_id = fleet.submit({"image": image, "command": ["sh", "-c", JOB], "gpu_count": 2})
        job = fleet.wait_status(job_id, TERMINAL, timeout_s=120)
        assert job["status"] == "SUCCEEDED", job
        (attempt,) = job["attempts"]
        phases = attempt["start_phases"]
        assert (phases["runtime"], phases["image"]) == ("container", "cold")
        assert phases["pull_s"] > 0 and phases["create_s"] > 0 and phases["start_s"] > 0
        gpus = ",".join(str(g) for g in attempt["gpu_ids"])

        store, manifest = _manifest(fleet, attempt)
        files = {(f.kind, f.path): f for f in manifest.files}
        assert store.get_bytes(files["artifact", "gpus.txt"].key).decode() == gpus + "\n"
        with fleet.http() as c:
            log = c.get(f"/v1/jobs/{job_id}/logs").text
        assert f"gpus={gpus}" in log
        lines = [ln for ln in log.splitlines() if ln.startswith("line-")]
        assert lines == [f"line-{i}" for i in range(500)] and "the-end" in log

        # the node now reports the image; the next job with it starts warm
        fleet.wait_for(
            lambda: image in fleet.get("/v1/nodes")["items"][0]["images"], 30, "image report"
        )
        second = fleet.submit({"image": image, "command": ["true"], "gpu_count": 1})
        job2 = fleet.wait_status(second, TERMINAL, timeout_s=120)
        assert job2["status"] == "SUCCEEDED", job2
        phases2 = job2["attempts"][0]["start_phases"]
        assert phases2["image"] == "warm"
        assert phases_text(phases2).startswith("warm image: pull ")
        events = fleet.get(f"/v1/jobs/{second}/events")["items"]
        assert any("container, warm image" in (e["message"] or "") for e in events)
        assert fleet.check() == []
    finally:
        engine.remove_image(image)


def test_cancel_of_a_container_ignoring_sigterm_removes_it_before_the_gpus_are_released(
    fleet: Fleet, engine: ContainerEngine
) -> None:
    fleet.start_agent("a1", gpus="4xH100-80GB")
    script = "trap 'echo ignoring' TERM; echo ready; while true; do sleep 0.1; done"
    job_id = fleet.submit({"image": BUSYBOX, "command": ["sh", "-c", script], "gpu_count": 2})
    job = fleet.wait_status(job_id, {"RUNNING"}, timeout_s=60)
    run_id = job["attempts"][0]["run_id"]
    fleet.wait_for(lambda: engine.find(LABEL_RUN, run_id), 30, "the container")
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 202
    released_while_present = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        free = fleet.get("/v1/nodes")["items"][0]["available_gpus"]
        present = bool(engine.find(LABEL_RUN, run_id))
        if present and free != 2:
            released_while_present.append(free)
        if not present and fleet.job(job_id)["status"] in TERMINAL:
            break
        time.sleep(0.05)
    job = fleet.wait_status(job_id, TERMINAL)
    assert released_while_present == []
    assert job["status"] == "CANCELLED"
    assert engine.find(LABEL_RUN, run_id) == []
    assert fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 4
    with fleet.http() as c:
        assert "ignoring" in c.get(f"/v1/jobs/{job_id}/logs").text
    assert fleet.check() == []


def test_the_readme_example_workload_runs_as_a_container_job(fleet: Fleet) -> None:
    fleet.start_agent("a1", gpus="2xH100-80GB")
    job_id = fleet.submit(
        {
            "image": PYTHON,
            "command": ["python3", "/opt/gpufleet/train_digits.py", "--steps", "40"],
            "gpu_count": 1,
        }
    )
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=180)
    assert job["status"] == "SUCCEEDED", job
    _, manifest = _manifest(fleet, job["attempts"][0])
    paths = {f.path for f in manifest.files if f.kind == "artifact"}
    assert {"metrics.json", "model.npz"} <= paths


def test_timeout_of_a_container_ignoring_sigterm_ends_with_it_gone(
    fleet: Fleet, engine: ContainerEngine
) -> None:
    fleet.start_agent("a1", gpus="2xH100-80GB")
    script = "trap 'echo ignoring' TERM; while true; do sleep 0.1; done"
    job_id = fleet.submit(
        {"image": BUSYBOX, "command": ["sh", "-c", script], "gpu_count": 1, "max_runtime_s": 2}
    )
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=90)
    assert job["status"] == "FAILED" and job["failure_reason"].startswith("TIMEOUT"), job
    assert engine.find(LABEL_RUN, job["attempts"][0]["run_id"]) == []
    assert fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 2
    assert fleet.check() == []


@pytest.mark.fleet_settings(retry_backoff_s=0.2, retry_backoff_cap_s=0.5)
def test_badly_named_images_fail_their_jobs_and_cordon_no_node(fleet: Fleet) -> None:
    """Replay of a hostile tenant's submits on a 3-node fleet: images that are podman options
    or upper-case are refused at submit (422 naming ``image``); an image on an unreachable
    registry fails its attempts as the job's fault with one generic reason, each retry on
    another node than the attempt before it, and no node is cordoned."""
    for node_id in ("a1", "a2", "a3"):
        fleet.start_agent(node_id, gpus="2xH100-80GB")
    with fleet.http() as c:
        for image in ("--help", "--privileged", "--volume=/:/host", "UPPER/case"):
            r = c.post("/v1/jobs", json={"image": image, "command": ["true"], "gpu_count": 1})
            assert r.status_code == 422, r.text
            assert r.json()["field"] == "image", r.json()
    jobs = [
        fleet.submit(
            {
                "image": "127.0.0.1:1/gpufleet/x:1",  # nothing listens on port 1
                "command": ["true"],
                "gpu_count": 1,
                "max_retries": 2,
            }
        )
        for _ in range(3)
    ]
    for job_id in jobs:
        job = fleet.wait_status(job_id, TERMINAL, timeout_s=180)
        assert job["status"] == "FAILED", job
        assert "unreachable or not a registry" in job["failure_reason"], job["failure_reason"]
        attempts = job["attempts"]
        assert len(attempts) == 3, attempts  # max_retries used: the job's fault
        assert all("cannot pull image" in (a["message"] or "") for a in attempts), attempts
        nodes = [a["node_id"] for a in attempts]
        assert all(x != y for x, y in itertools.pairwise(nodes)), nodes
    statuses = {n["node_id"]: n["status"] for n in fleet.get("/v1/nodes")["items"]}
    assert statuses == {"a1": "HEALTHY", "a2": "HEALTHY", "a3": "HEALTHY"}, statuses
    assert fleet.check() == []


def test_a_registry_answering_with_node_fault_words_cordons_no_node(fleet: Fleet) -> None:
    """Replay of a hostile registry: ``/v2/`` 200, every manifest 404 with "no space left on
    device" in the error's message. With ``max_retries`` 0 the job ends FAILED after one
    attempt (its own fault, not re-placed as the node's), and every node stays HEALTHY."""
    from tests.integration.test_container_runtime import HOSTILE_MANIFEST, _http_registry

    for node_id in ("h1", "h2"):
        fleet.start_agent(node_id, gpus="2xH100-80GB")
    with _http_registry(200, HOSTILE_MANIFEST) as (port, seen):
        jobs = [
            fleet.submit(
                {
                    "image": f"127.0.0.1:{port}/evil/img:1",
                    "command": ["id"],
                    "gpu_count": 1,
                    "max_retries": 0,
                }
            )
            for _ in range(3)
        ]
        for job_id in jobs:
            job = fleet.wait_status(job_id, TERMINAL, timeout_s=180)
            assert job["status"] == "FAILED", job
            assert len(job["attempts"]) == 1, job["attempts"]
            assert "not found in registry" in job["failure_reason"], job["failure_reason"]
            assert "no space" not in job["failure_reason"], job["failure_reason"]
    assert any("/manifests/" in p for p in seen), seen
    statuses = {n["node_id"]: n["status"] for n in fleet.get("/v1/nodes")["items"]}
    assert statuses == {"h1": "HEALTHY", "h2": "HEALTHY"}, statuses
    assert fleet.check() == []


def test_cancel_during_a_pull_from_a_hung_registry_frees_the_gpus(fleet: Fleet) -> None:
    """Replay: jobs whose registry accepts and never answers stay SCHEDULED while their pull
    waits; a cancel ends the pulls, the jobs end CANCELLED and every GPU is free again (not
    after the pull timeout)."""
    from tests.integration.test_container_runtime import _pulls_of, _silent_server

    fleet.start_agent("p1", gpus="4xH100-80GB")
    with _silent_server() as port:
        image = f"127.0.0.1:{port}/hung/img:1"
        jobs = [
            fleet.submit({"image": image, "command": ["true"], "gpu_count": 1}) for _ in range(4)
        ]
        for job_id in jobs:
            fleet.wait_status(job_id, {"SCHEDULED", "RUNNING"}, timeout_s=60)
        fleet.wait_for(
            lambda: fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 0, 30, "all GPUs held"
        )
        fleet.wait_for(lambda: len(_pulls_of(image)) >= 1, 30, "the pulls")
        with fleet.http() as c:
            for job_id in jobs:
                assert c.delete(f"/v1/jobs/{job_id}").status_code == 202
        for job_id in jobs:
            assert fleet.wait_status(job_id, TERMINAL, timeout_s=120)["status"] == "CANCELLED"
        fleet.wait_for(
            lambda: fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 4, 60, "GPUs freed"
        )
        assert _pulls_of(image) == []
    assert fleet.check() == []


def _kill_conmon(engine: ContainerEngine, run_id: str) -> None:
    """SIGKILL the podman monitor (conmon) of the container ``run_id``."""
    out = subprocess.run(
        [*engine.argv0, "inspect", "--format", "{{.State.ConmonPid}}", run_id],
        env=engine.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    os.kill(int(out.strip()), signal.SIGKILL)


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_a_container_whose_conmon_dies_ends_and_frees_its_gpus_and_can_be_cancelled(
    fleet: Fleet, engine: ContainerEngine
) -> None:
    """Replay (issue 24, 7): conmon SIGKILLed while the command runs. podman says "running"
    for good; the job used to stay RUNNING with its GPUs reserved, and a cancel left it
    PREEMPTING ("container survives SIGKILL"). The agent watches the container's cgroup: the
    job ends once its processes are gone, the cancel finishes, every GPU is free again."""
    fleet.start_agent("a1", gpus="4xH100-80GB")
    ends = fleet.submit(
        {"image": BUSYBOX, "command": ["sh", "-c", "echo ready; sleep 4"], "gpu_count": 2}
    )
    script = "trap 'echo ignoring' TERM; echo ready; while true; do sleep 0.1; done"
    cancelled = fleet.submit({"image": BUSYBOX, "command": ["sh", "-c", script], "gpu_count": 2})
    runs = {}
    for job_id in (ends, cancelled):
        job = fleet.wait_status(job_id, {"RUNNING"}, timeout_s=60)
        runs[job_id] = job["attempts"][0]["run_id"]
        fleet.wait_for(lambda r=runs[job_id]: engine.find(LABEL_RUN, r), 30, "the container")
        _kill_conmon(engine, runs[job_id])
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{cancelled}").status_code == 202
    job = fleet.wait_status(cancelled, TERMINAL, timeout_s=30)
    assert job["status"] == "CANCELLED", job
    job = fleet.wait_status(ends, TERMINAL, timeout_s=30)
    assert job["status"] == "FAILED", job  # its exit status is lost: not a success
    assert "exit status lost" in (fleet.tmp / "agent-a1.log").read_text()
    assert "conmon) died: exit status lost" in job["failure_reason"], job  # said to the user
    fleet.wait_for(
        lambda: fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 4, 30, "GPUs freed"
    )
    assert all(engine.find(LABEL_RUN, r) == [] for r in runs.values())
    assert fleet.check() == []


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
@pytest.mark.fleet_settings(retry_backoff_s=0.1, retry_backoff_cap_s=0.2)
def test_oom_verdicts_of_containers_follow_the_kernels_oom_kill_count(fleet: Fleet) -> None:
    """Replay (issue 24, 8): a container (memory_mb 64) that fills its cgroup with page cache
    (no OOM) and then dies of SIGKILL used to be OOM_KILLED with its retries skipped; one whose
    child was OOM-killed and that then exited 1 said "exited with code 1". Now: FAILED after
    its retries, and OOM_KILLED (not retried), as the process runtime says."""
    fleet.start_agent("a1", gpus="2xH100-80GB")
    page_cache = "dd if=/dev/zero of=/tmp/fill bs=1M count=160 2>/dev/null; sync; kill -9 $$"
    child_oom = 'sh -c "x=\\$(head -c 200000000 /dev/zero | tr \\"\\\\0\\" a)"; exit 1'
    filler = fleet.submit(
        {
            "image": BUSYBOX,
            "command": ["sh", "-c", page_cache],
            "gpu_count": 1,
            "memory_mb": 64,
            "max_retries": 2,
        }
    )
    oom = fleet.submit(
        {
            "image": BUSYBOX,
            "command": ["sh", "-c", child_oom],
            "gpu_count": 1,
            "memory_mb": 32,
            "max_retries": 2,
        }
    )
    job = fleet.wait_status(filler, TERMINAL, timeout_s=60)
    assert job["status"] == "FAILED", job
    assert len(job["attempts"]) == 3, job["attempts"]  # its retries were used
    assert "OOM_KILLED" not in (job["failure_reason"] or ""), job["failure_reason"]
    job = fleet.wait_status(oom, TERMINAL, timeout_s=60)
    assert job["status"] == "FAILED", job
    assert (job["failure_reason"] or "").startswith("OOM_KILLED"), job["failure_reason"]
    assert len(job["attempts"]) == 1, job["attempts"]
    assert fleet.check() == []
