"""Containment through the whole platform: a real controller, API and agent subprocess, jobs as
per-attempt uids in cgroups (this development machine: cgroup v1, root).

Jobs run a system Python so that unprivileged job uids can execute it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.agent.runtime.containment import detect
from gpufleet.objectstore import ObjectStore
from tests.e2e.harness import TERMINAL, Fleet
from tests.e2e.test_cli_and_demo import cli

SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, job users)"),
    pytest.mark.skipif(
        not detect("probe").kind.startswith("cgroup"), reason="no cgroup containment here"
    ),
]

OOM_JOB = (
    "import time\n"
    "blocks = []\n"
    "for _ in range(64):\n"
    "    blocks.append(bytearray(16 * 1024 * 1024)); time.sleep(0.01)\n"
    "print('survived')\n"
)

ESCAPER = (
    "import os, sys, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "time.sleep(600)'\n"
    "    os.execv(sys.executable, [sys.executable, '-c', code, sys.argv[1] + '-child'])\n"
    "time.sleep(600)\n"
)


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) pids whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if marker.encode() in cmdline and stat[stat.rfind(")") + 2] not in "ZX":
            found.append(int(name))
    return found


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    """Test hygiene: a failed test must not leave its jobs running (they outlive the agent)."""
    yield
    for pid in processes_with("gf-e2e-"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_oom_job_fails_with_oom_killed_while_a_neighbour_runs_on(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # the CLI's tables, unwrapped
    fleet.start_agent("a1", job_uids="per-attempt")
    marker = f"gf-e2e-neighbour-{uuid.uuid4().hex}"
    neighbour = fleet.submit(
        {
            "command": [SYSTEM_PY, "-c", "import time; time.sleep(600)", marker],
            "gpu_count": 1,
            "memory_mb": 128,
        }
    )
    fleet.wait_status(neighbour, {"RUNNING"})

    hog = fleet.submit(
        {
            "command": [SYSTEM_PY, "-c", OOM_JOB],
            "gpu_count": 1,
            "memory_mb": 64,
            "max_retries": 2,
        }
    )

    job = fleet.wait_status(hog, TERMINAL, timeout_s=60)
    assert job["status"] == "FAILED", job
    assert job["failure_reason"].startswith("OOM_KILLED"), job["failure_reason"]
    assert "memory_mb=64" in job["failure_reason"]
    assert len(job["attempts"]) == 1, "an OOM is not retried: the next attempt would hit it too"
    events = fleet.get(f"/v1/jobs/{hog}/events")["items"]
    assert any("OOM_KILLED" in (e["message"] or "") for e in events)
    status = cli(fleet, "status", hog)
    assert "OOM_KILLED" in status.stdout + status.stderr
    assert fleet.job(neighbour)["status"] == "RUNNING"
    assert processes_with(marker), "the neighbour was hit"

    nodes = cli(fleet, "nodes", "--wide")
    assert nodes.returncode == 0, nodes.stderr
    assert "cgroup-v1, gpufleet-job/uid-per-attempt" in nodes.stdout or (
        "cgroup-v2, gpufleet-job/uid-per-attempt" in nodes.stdout
    ), nodes.stdout
    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{neighbour}").status_code == 202
    assert fleet.wait_status(neighbour, TERMINAL)["status"] == "CANCELLED"
    assert processes_with(marker) == []
    assert fleet.check() == []


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_cancel_releases_gpus_only_after_an_escaped_setsid_child_is_gone(fleet: Fleet) -> None:
    fleet.start_agent("a1", job_uids="per-attempt")
    marker = f"gf-e2e-escaper-{uuid.uuid4().hex}"
    job_id = fleet.submit({"command": [SYSTEM_PY, "-c", ESCAPER, marker], "gpu_count": 4})
    fleet.wait_status(job_id, {"RUNNING"})
    fleet.wait_for(lambda: processes_with(marker + "-child"), 15, "the setsid child")

    with fleet.http() as c:
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 202
    released_while_alive = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        free = fleet.get("/v1/nodes")["items"][0]["available_gpus"]  # capacity first
        alive = processes_with(marker)
        if alive and free != 4:
            released_while_alive.append((free, alive))
        if not alive and fleet.job(job_id)["status"] in TERMINAL:
            break
        time.sleep(0.05)

    job = fleet.wait_status(job_id, TERMINAL)
    assert released_while_alive == []
    assert processes_with(marker) == []
    assert job["status"] == "CANCELLED"
    assert fleet.get("/v1/nodes")["items"][0]["available_gpus"] == 8
    assert fleet.check() == []


FILLER = (
    "import os\n"
    "d = os.environ['GPUFLEET_CHECKPOINT_DIR']\n"
    "open(os.path.join(d, 'step.txt'), 'w').write('step 3')\n"
    "with open(os.path.join(d, 'huge.bin'), 'wb') as f:\n"
    "    while True:\n"
    "        f.write(b'x' * 1048576); f.flush()\n"
)

NEIGHBOUR = (
    "import json, os, sys, time\n"
    "art = os.environ['GPUFLEET_ARTIFACTS_DIR']\n"
    "while not os.path.exists(os.path.join(art, 'go')):\n"
    "    time.sleep(0.05)\n"
    "group = [l.split(':')[2].strip() for l in open('/proc/self/cgroup') if ':pids:' in l]\n"
    "pids_max = open('/sys/fs/cgroup/pids' + group[0] + '/pids.max').read().strip()\n"
    "st = os.statvfs(art)\n"
    "json.dump({'pids_max': pids_max, 'disk_mb': st.f_blocks * st.f_frsize // 1048576},\n"
    "          open(os.path.join(art, 'bounds.json'), 'w'))\n"
)


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_job_filling_its_disk_fails_alone_with_disk_full_and_the_node_stays_healthy(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpufleet.agent.runner import JOBS_ROOT, agent_scope

    monkeypatch.setenv("COLUMNS", "300")
    if not detect("probe").pids:
        pytest.skip("no pids controller")
    state = fleet.tmp / "agents" / "a1"
    fleet.start_agent(
        "a1",
        job_uids="per-attempt",
        state_dir=state,
        args=("--job-disk-mb", "64", "--job-pids-max", "300"),
    )
    sub = cli(
        fleet,
        "submit",
        "--gpus",
        "1",
        "--pids-limit",
        "77",
        "--disk-mb",
        "40",
        "--workdir",
        "-",
        "-q",
        "--",
        SYSTEM_PY,
        "-c",
        NEIGHBOUR,
        "gf-e2e-disk-neighbour",
    )
    assert sub.returncode == 0, sub.stderr
    neighbour = sub.stdout.strip()
    fleet.wait_status(neighbour, {"RUNNING"})

    filler = fleet.submit(
        {"command": [SYSTEM_PY, "-c", FILLER], "gpu_count": 1, "disk_mb": 32, "max_retries": 2}
    )

    job = fleet.wait_status(filler, TERMINAL, timeout_s=60)
    assert job["status"] == "FAILED", job
    assert job["failure_reason"].startswith("DISK_FULL"), job["failure_reason"]
    assert "disk_mb=32" in job["failure_reason"]
    assert len(job["attempts"]) == 1, "a full disk is not retried: the next would fill it too"
    status = cli(fleet, "status", filler)
    assert "DISK_FULL" in status.stdout + status.stderr
    node = fleet.get("/v1/nodes")["items"][0]
    assert node["status"] == "HEALTHY", node
    labels = node["labels"]
    assert labels["gpufleet/job-pids-max"] == "300"
    assert labels["gpufleet/job-disk-mb"] == "64"
    nodes = cli(fleet, "nodes", "--wide")
    assert "pids-max: 300, disk-mb: 64, isolation: no-new-privs" in nodes.stdout, nodes.stdout

    run_id = fleet.job(neighbour)["attempts"][0]["run_id"]
    go = JOBS_ROOT / agent_scope(state.resolve(), "a1") / run_id / "artifacts" / "go"
    go.touch()
    done = fleet.wait_status(neighbour, TERMINAL, timeout_s=60)
    assert done["status"] == "SUCCEEDED", done
    assert (done["pids_limit"], done["disk_mb"]) == (77, 40)
    store = ObjectStore(fleet.settings.resolved_object_store_url())
    bounds = json.loads(
        store.get_bytes(f"jobs/{neighbour}/attempts/{run_id}/artifacts/bounds.json")
    )
    assert bounds["pids_max"] == "77"
    assert 30 <= bounds["disk_mb"] <= 40
    assert fleet.check() == []
