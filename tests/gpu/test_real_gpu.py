"""On a machine with an NVIDIA GPU and its driver: the agent's NVML inventory and health checks
against the real driver, and real CUDA jobs pinned by the platform.

Everywhere else (CI, the development machines) NVML finds no GPU and these tests skip: the GPU
is this project's one true external edge, and the rest of the suite stands in for it with
declared GPUs (``--gpus 8xH100-80GB``) and a fake ``pynvml``. ``scripts/device-check.sh`` runs
this file on a GPU machine; the results are in docs/design/runtime.md ("Checked on a real GPU").

What is independent of our code here: ``nvidia-smi`` (the driver's own tool) for the inventory,
and PyTorch's CUDA runtime inside the job for what the job can see.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.agent.gpu_health import GpuHealth
from gpufleet.agent.inventory import gpu_type_from_name, load_inventory, nvml_gpus
from tests.e2e.harness import TERMINAL, Fleet

GPUS = nvml_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="NVML sees no NVIDIA GPU on this machine"),
]


def smi() -> list[dict[str, str]]:
    """``nvidia-smi``'s view of the GPUs: index, uuid, name, memory.total (MiB)."""
    fields = ["index", "uuid", "name", "memory.total"]
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [
        dict(zip(fields, (c.strip() for c in line.split(",")), strict=True))
        for line in out.splitlines()
        if line.strip()
    ]


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi is not installed")
def test_the_inventory_is_what_the_driver_reports() -> None:
    inv = load_inventory("gpu-node", "8xH100-80GB")  # a wrong declaration: NVML must win
    assert inv.source == "nvml"
    rows = smi()
    assert [(g.index, g.uuid) for g in inv.gpus] == [(int(r["index"]), r["uuid"]) for r in rows]
    for g, r in zip(inv.gpus, rows, strict=True):
        assert g.gpu_type == gpu_type_from_name(r["name"])
        assert "NVIDIA" not in g.gpu_type and g.gpu_type
        # NVML gives bytes (floored to MiB here); nvidia-smi prints MiB
        assert abs(g.memory_mb - int(r["memory.total"])) <= 1


def test_a_healthy_gpu_passes_the_health_checks() -> None:
    """The real driver answers (or declines, where a board lacks ECC or XID events) every
    query GpuHealth makes, and a working GPU is not reported unhealthy."""
    assert GPUS
    health = GpuHealth.for_inventory(GPUS, "nvml")
    assert health.nvml is not None
    assert health.problem() is None


JOB = """
import json, os, sys, time, torch
hold_s = float(sys.argv[1])
seen = {
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "order": os.environ.get("CUDA_DEVICE_ORDER"),
    "count": torch.cuda.device_count(),
    "start": time.time(),
}
p = torch.cuda.get_device_properties(0)
seen["uuid"] = "GPU-" + str(p.uuid)
a = torch.randn(2048, 2048, device="cuda")
seen["matmul_ok"] = bool(torch.allclose(a @ torch.eye(2048, device="cuda"), a))
try:  # who holds a CUDA context on this GPU while this job does (the driver's answer)
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByUUID(seen["uuid"])
    seen["gpu_pids"] = sorted(x.pid for x in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
except Exception as exc:
    seen["gpu_pids"] = repr(exc)
seen["pid"] = os.getpid()
time.sleep(hold_s)
seen["end"] = time.time()
print("SEEN " + json.dumps(seen), flush=True)
"""


def submit_job(fleet: Fleet, marker: str, hold_s: float = 0.0) -> str:
    return fleet.submit(
        {"command": [sys.executable, "-c", JOB, str(hold_s), marker], "gpu_count": 1}
    )


def seen_by(fleet: Fleet, job_id: str) -> dict[str, object]:
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=180)
    with fleet.http() as c:
        log = c.get(f"/v1/jobs/{job_id}/logs").text
    assert job["status"] == "SUCCEEDED", log
    line = next(x for x in log.splitlines() if x.startswith("SEEN "))
    return dict(json.loads(line.removeprefix("SEEN ")))


def test_a_job_sees_exactly_the_gpu_it_was_given(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    fleet = Fleet(tmp_path).start()
    try:
        fleet.start_agent("gpu-node")  # declares 8xH100-80GB; NVML must win
        node = fleet.node("gpu-node")
        assert node["total_gpus"] == len(GPUS), node
        assert node["gpu_type"] == GPUS[0].gpu_type, node
        assert node["gpu_memory_mb"] == GPUS[0].memory_mb, node

        mark = f"gpufleet-test-marker-{tmp_path.name}"
        one = seen_by(fleet, submit_job(fleet, mark))
        assert one["count"] == 1, one
        assert one["order"] == "PCI_BUS_ID"
        index = int(str(one["visible"]))
        assert one["uuid"] == GPUS[index].uuid, (one, GPUS)  # CUDA's device 0 is the reserved one
        assert one["matmul_ok"] is True

        # every GPU of the node asked for at once, twice: the second wave waits for the first
        # to end, and while a job holds its GPU the driver shows no other process on it
        n = len(GPUS)
        ids = [submit_job(fleet, mark, hold_s=3.0) for _ in range(2 * n)]
        runs = [seen_by(fleet, j) for j in ids]
        for r in runs:
            if isinstance(r["gpu_pids"], str):  # a board or VM without process accounting
                assert "NotSupported" in r["gpu_pids"], r
            else:
                assert r["gpu_pids"] == [r["pid"]], r
        for uuid in {str(r["uuid"]) for r in runs}:
            spans = sorted((float(r["start"]), float(r["end"])) for r in runs if r["uuid"] == uuid)  # type: ignore[arg-type]
            for (_, end), (start, _) in itertools.pairwise(spans):
                assert start >= end, f"two jobs on {uuid} at once: {spans}"
        assert fleet.check() == []
    finally:
        fleet.stop()
