"""GPU shares with real agents and real job processes, on both databases: two 0.5-GPU jobs
share one declared GPU (the same CUDA_VISIBLE_DEVICES, both RUNNING at once), a third waits,
a whole-GPU job never lands on the shared GPU, and a cancelled share is given back only
after its processes are verified gone."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow


def share_job(tmp: Path, name: str, marker: str) -> list[str]:
    """Writes its GPU variables and process group to ``tmp/<name>.json``, ignores SIGTERM
    (only the SIGKILL after the grace period stops it), sleeps."""
    code = (
        "import json, os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " e = {k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'GPUFLEET_GPU_FRACTION',"
        " 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')}; e['pgid'] = os.getpgid(0);"
        f" open({str(tmp / (name + '.tmp'))!r}, 'w').write(json.dumps(e));"
        f" os.rename({str(tmp / (name + '.tmp'))!r}, {str(tmp / (name + '.json'))!r});"
        " time.sleep(600)"
    )
    return [sys.executable, "-c", code, marker]


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_two_halves_share_a_gpu_a_third_waits_and_a_cancel_gives_the_share_back(
    fleet: Fleet,
) -> None:
    fleet.start_agent("s1", gpus="1xH100-80GB", args=("--gpu-sharing", "mps"))
    fleet.start_agent("w1", gpus="1xH100-80GB")  # whole GPUs only
    assert fleet.node("s1")["gpu_sharing"] == "mps"
    assert fleet.node("w1")["gpu_sharing"] == "none"
    fleet.start_sampling()
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    tmp = fleet.tmp

    def submit_share(name: str) -> str:
        return fleet.submit({"command": share_job(tmp, name, marker), "gpu_fraction": 0.5})

    a, b = submit_share("a"), submit_share("b")
    for job_id in (a, b):
        fleet.wait_status(job_id, {"RUNNING"}, timeout_s=30)
    fleet.wait_for(lambda: (tmp / "a.json").exists() and (tmp / "b.json").exists(), 10, "env")
    env_a, env_b = (json.loads((tmp / f"{n}.json").read_text()) for n in ("a", "b"))
    assert env_a["CUDA_VISIBLE_DEVICES"] == env_b["CUDA_VISIBLE_DEVICES"] == "0"
    assert env_a["GPUFLEET_GPU_FRACTION"] == "0.5"
    assert env_a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert {fleet.job(j)["attempts"][-1]["node_id"] for j in (a, b)} == {"s1"}
    s1 = fleet.node("s1")
    assert (s1["available_gpus"], s1["shared_gpus"]) == (0, {"0": 1.0})

    c = submit_share("c")  # the shared GPU is full and w1 does not share
    whole = fleet.submit({"command": share_job(tmp, "w", marker), "gpu_count": 1})
    fleet.wait_status(whole, {"RUNNING"}, timeout_s=30)
    assert fleet.job(whole)["attempts"][-1]["node_id"] == "w1"
    whole2 = fleet.submit({"command": share_job(tmp, "w2", marker), "gpu_count": 1})
    time.sleep(2)  # several scheduler passes (0.5 s ticks)
    assert fleet.job(c)["status"] == "PENDING"
    assert fleet.job(whole2)["status"] == "PENDING"  # never on the shared GPU

    # cancel a: its share comes back only once its process group is gone (SIGKILL after
    # the grace period), and then c takes it
    with fleet.http() as h:
        assert h.delete(f"/v1/jobs/{a}").status_code == 202
    early = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status_c = fleet.job(c)["status"]
        if alive(env_a["pgid"]) and status_c != "PENDING":
            early.append(status_c)
        if not alive(env_a["pgid"]) and status_c == "RUNNING":
            break
        time.sleep(0.05)
    assert early == []
    assert fleet.job(a)["status"] == "CANCELLED"
    fleet.wait_status(c, {"RUNNING"}, timeout_s=10)
    assert fleet.job(c)["attempts"][-1]["node_id"] == "s1"
    fleet.wait_for(lambda: (tmp / "c.json").exists(), 10, "c's env")
    assert json.loads((tmp / "c.json").read_text())["CUDA_VISIBLE_DEVICES"] == "0"
    assert fleet.job(whole2)["status"] == "PENDING"  # b and c still share the GPU

    # the last shares cancelled: the GPU is whole again and the waiting whole job takes it
    with fleet.http() as h:
        for job_id in (b, c):
            assert h.delete(f"/v1/jobs/{job_id}").status_code == 202
    fleet.wait_status(whole2, {"RUNNING"}, timeout_s=30)
    assert fleet.job(whole2)["attempts"][-1]["node_id"] == "s1"
    for job_id in (b, c):
        assert fleet.wait_status(job_id, TERMINAL)["status"] == "CANCELLED"
    assert fleet.node("s1")["shared_gpus"] == {}
    assert fleet.check() == []
    assert fleet.violations == [] and fleet.samples > 0
