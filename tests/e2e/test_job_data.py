"""Job data through the whole platform (issue 26): host mounts into container jobs, limited
to the paths the fleet and the node allow, and the size of ``/dev/shm`` in containers and
process jobs. Real controller, API and agent subprocess; containers are podman's (the local
registry's images, ``tests/container_support.py``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpufleet.agent.runtime.container import ContainerEngine
from gpufleet.agent.runtime.containment import detect
from tests.container_support import BUSYBOX
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow

SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


def _log(fleet: Fleet, job_id: str) -> str:
    with fleet.http() as c:
        return c.get(f"/v1/jobs/{job_id}/logs").text


def _shm_mb(log: str) -> int:
    """The size column of ``df -m /dev/shm``'s line."""
    line = next(ln for ln in log.splitlines() if ln.rstrip().endswith("/dev/shm"))
    return int(line.split()[1])


@pytest.fixture
def data_dirs(tmp_path: Path) -> tuple[Path, Path]:
    allowed = tmp_path / "datasets"
    (allowed / "mnist").mkdir(parents=True)
    (allowed / "mnist" / "train.txt").write_text("hello from the host\n")
    os.chmod(tmp_path, 0o755)
    for d in (allowed, allowed / "mnist"):
        os.chmod(d, 0o755)
    os.chmod(allowed / "mnist" / "train.txt", 0o644)
    other = tmp_path / "secrets"
    other.mkdir()
    (other / "key").write_text("not for jobs\n")
    return allowed, other


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_container_mounts_an_allowed_host_dir_and_gets_its_shm_size(
    fleet: Fleet, data_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    allowed, other = data_dirs
    ContainerEngine("podman", state_dir=tmp_path / "engine-test").ensure_present(BUSYBOX)
    fleet.settings.allowed_mounts = f"{allowed},{other}"
    fleet.start_agent("a1", gpus="2xH100-80GB", args=("--allow-mount", str(allowed)))

    job_id = fleet.submit(
        {
            "image": BUSYBOX,
            "command": [
                "sh",
                "-c",
                "cat /data/train.txt; df -m /dev/shm; touch /data/x 2>/dev/null || echo ro-ok",
            ],
            "gpu_count": 1,
            "mounts": [f"{allowed / 'mnist'}:/data:ro"],
            "shm_size_mb": 300,
        }
    )
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=120)
    assert job["status"] == "SUCCEEDED", job
    assert job["mounts"] == [
        {"source": str(allowed / "mnist"), "target": "/data", "read_only": True}
    ]
    log = _log(fleet, job_id)
    assert "hello from the host" in log and "ro-ok" in log, log
    assert _shm_mb(log) == 300, log

    # no --shm-size: a quarter of memory_mb (8192 -> 2048), not podman's 64 MB
    default = fleet.submit(
        {"image": BUSYBOX, "command": ["df", "-m", "/dev/shm"], "memory_mb": 8192}
    )
    job = fleet.wait_status(default, TERMINAL, timeout_s=120)
    assert job["status"] == "SUCCEEDED", job
    assert _shm_mb(_log(fleet, default)) == 2048

    # allowed by the fleet, not by this node: the start fails naming the field
    refused = fleet.submit({"image": BUSYBOX, "command": ["true"], "mounts": [f"{other}:/s"]})
    job = fleet.wait_status(refused, TERMINAL, timeout_s=60)
    assert job["status"] == "FAILED", job
    assert "mounts[0].source" in job["failure_reason"], job["failure_reason"]
    assert "--allow-mount" in job["failure_reason"]
    assert fleet.check() == []


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_a_mount_outside_the_fleets_allow_list_is_refused_at_submit(
    fleet: Fleet, data_dirs: tuple[Path, Path]
) -> None:
    allowed, other = data_dirs
    fleet.settings.allowed_mounts = str(allowed)
    with fleet.http() as c:
        body = {"image": BUSYBOX, "command": ["true"], "mounts": [f"{other}:/s"]}
        r = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": "m1"})
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "mounts[0].source", r.json()
        bad_target = {"image": BUSYBOX, "command": ["true"], "mounts": [f"{allowed}:/proc/x"]}
        r = c.post("/v1/jobs", json=bad_target, headers={"Idempotency-Key": "m2"})
        assert r.status_code in (400, 422), r.text
        assert r.json()["field"] == "mounts[0].target", r.json()
        process = {"command": ["true"], "mounts": [f"{allowed}:/data"]}
        r = c.post("/v1/jobs", json=process, headers={"Idempotency-Key": "m3"})
        assert r.status_code in (400, 422), r.text
        assert r.json()["field"] == "mounts", r.json()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (job users, mount namespace)")
@pytest.mark.skipif(not detect("probe").kind.startswith("cgroup"), reason="no cgroups here")
@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_process_job_gets_a_private_dev_shm_of_its_size(fleet: Fleet) -> None:
    fleet.start_agent("a1", gpus="2xH100-80GB", job_uids="per-attempt")
    job_id = fleet.submit({"command": ["df", "-m", "/dev/shm"], "shm_size_mb": 200})
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert job["status"] == "SUCCEEDED", job
    assert _shm_mb(_log(fleet, job_id)) == 200
    default = fleet.submit({"command": ["df", "-m", "/dev/shm"], "memory_mb": 6000})
    job = fleet.wait_status(default, TERMINAL, timeout_s=60)
    assert job["status"] == "SUCCEEDED", job
    assert _shm_mb(_log(fleet, default)) == 1500


ALLOCATE_200MB = (
    "import time\n"
    "block = bytearray(200 * 1024 * 1024)\n"
    "for i in range(0, len(block), 4096):\n"
    "    block[i] = 1\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.3:\n"
    "    pass\n"
    "print('allocated', len(block))\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, job users)")
@pytest.mark.skipif(not detect("probe").kind.startswith("cgroup"), reason="no cgroups here")
@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_peak_rss_and_cpu_time_of_an_attempt_in_status_and_usage(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.e2e.test_cli_and_demo import cli

    monkeypatch.setenv("COLUMNS", "300")
    fleet.start_agent("a1", gpus="2xH100-80GB", job_uids="per-attempt")
    job_id = fleet.submit({"command": [SYSTEM_PY, "-c", ALLOCATE_200MB], "memory_mb": 1024})
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert job["status"] == "SUCCEEDED", job
    used = job["attempts"][0]["resources"]
    assert used["peak_rss_bytes"] >= 200 * 1024 * 1024, used
    assert used["peak_rss_bytes"] < 1024 * 1024 * 1024, used
    assert used["cpu_seconds"] >= 0.3, used
    assert "gpu_util_pct" not in used  # no NVML on this node: not measured, not zero

    status = cli(fleet, "status", job_id)
    assert status.returncode == 0, status.stderr
    assert "attempt 1 used: peak RSS 2" in status.stdout, status.stdout
    usage = cli(fleet, "usage", "--by", "job")
    assert usage.returncode == 0, usage.stderr
    line = next(ln for ln in usage.stdout.splitlines() if job_id in ln)
    assert "MiB" in line and "peak RSS" in usage.stdout, usage.stdout
    data = fleet.get("/v1/usage?by=job")["items"]
    (mine,) = [ln for ln in data if ln["key"] == job_id]
    assert mine["peak_rss_bytes"] == used["peak_rss_bytes"]
    assert mine["gpu_util_pct"] is None
