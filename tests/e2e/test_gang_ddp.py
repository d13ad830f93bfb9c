"""examples/train_ddp.py as a 2 x 2-GPU gang through two real agents (issue 9 acceptance):

* the gang runs to SUCCEEDED, with per-rank logs and one accepted manifest (rank 0's) whose
  metrics match a 1-process run of the same script;
* killing one rank's process fails the gang attempt, the other rank is stopped (its process
  verified gone), and the retry, one new gang attempt with new tokens, resumes from the
  checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet.domain.manifest import Manifest
from gpufleet.objectstore import ObjectStore
from tests.e2e.harness import Fleet

pytest.importorskip("torch", reason="torch is missing: pip install -e '.[ddp]'")
pytest.importorskip("sklearn", reason="the examples extra (numpy, scikit-learn) is missing")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "train_ddp.py")
ARGS = ["--steps", "300", "--checkpoint-every", "20", "--seed", "7"]


def cli(fleet: Fleet, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        GPUFLEET_URL=fleet.api.url,
        GPUFLEET_TOKEN=fleet.tokens["vision"],
        GPUFLEET_CONFIG=str(fleet.tmp / "none.yaml"),
    )
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def place_if_waiting(fleet: Fleet, job_id: str, wait_s: float = 5.0) -> None:
    """Let the scheduler place the gang; if it has not within ``wait_s`` (a build whose
    policy does not place gangs yet), apply the ``PlaceGang`` decision through the live
    scheduler as tests/e2e/test_gangs.py does. Either way, wait for RUNNING (or an end)."""
    from gpufleet.controller.scheduler import PassStats
    from gpufleet.domain.errors import CapacityConflict, StaleState
    from gpufleet.policy.decisions import GangMember, PlaceGang
    from gpufleet.store.tables import JobRow

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and fleet.job(job_id)["status"] == "PENDING":
        time.sleep(0.2)
    with fleet.db.read() as s:
        row = s.get(JobRow, job_id)
        assert row is not None
        seen, status = row.fencing_epoch, row.status
    if status == "PENDING":
        decision = PlaceGang(job_id, (GangMember(0, "g0", 2), GangMember(1, "g1", 2)))
        with contextlib.suppress(StaleState, CapacityConflict):  # placed meanwhile
            fleet.controller.scheduler._place_gang(decision, seen, PassStats())
    fleet.wait_status(job_id, {"RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"}, 60)


def start_gang_agents(fleet: Fleet) -> None:
    for node in ("g0", "g1"):
        fleet.start_agent(node, gpus="2xH100-80GB", args=("--label", "rack=r1"))


def rank0_metrics(fleet: Fleet, job: dict[str, Any]) -> dict[str, Any]:
    """metrics.json from the job's accepted manifest (``result_uri``: rank 0's)."""
    store = ObjectStore(fleet.settings.resolved_object_store_url())
    uris = [job["result_uri"]]
    for uri in uris:
        manifest = Manifest.from_json(store.get_bytes(store.key_of(uri)))
        for f in manifest.files:
            if f.path.endswith("metrics.json"):
                return json.loads(store.get_bytes(f.key))  # type: ignore[no-any-return]
    raise AssertionError(f"no metrics.json in the manifests {uris}")


def one_process_reference(tmp: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        env.pop(k, None)
    env |= {
        "GPUFLEET_CHECKPOINT_DIR": str(tmp / "ref" / "ckpt"),
        "GPUFLEET_ARTIFACTS_DIR": str(tmp / "ref" / "artifacts"),
    }
    subprocess.run(
        [sys.executable, SCRIPT, *ARGS, "--step-sleep", "0"],
        env=env,
        check=True,
        timeout=120,
        capture_output=True,
    )
    return json.loads((tmp / "ref" / "artifacts" / "metrics.json").read_text())  # type: ignore[no-any-return]


def rank_processes(job_id: str) -> dict[int, int]:
    """{rank: pid} of the job's live train_ddp.py processes (they run as this user: the
    scenario agents use --job-uids agent), found through /proc environ."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"train_ddp.py" not in (proc / "cmdline").read_bytes():
                continue
            env = dict(
                item.split("=", 1)
                for item in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if env.get("GPUFLEET_JOB_ID") == job_id and "RANK" in env:
            found[int(env["RANK"])] = int(proc.name)
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1].startswith("Z")


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_ddp_gang_succeeds_with_per_rank_logs(fleet: Fleet, tmp_path: Path) -> None:
    start_gang_agents(fleet)
    sub = cli(
        fleet,
        "submit",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--name",
        "ddp",
        "--",
        sys.executable,
        SCRIPT,
        *ARGS,
        "--step-sleep",
        "0",
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = sub.stdout.strip().splitlines()[0]
    place_if_waiting(fleet, job_id)
    job = fleet.wait_status(job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, 180)
    assert job["status"] == "SUCCEEDED", job

    rank0 = cli(fleet, "logs", job_id)
    rank1 = cli(fleet, "logs", job_id, "--rank", "1")
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr + rank1.stderr
    assert "[rank 0] final test_acc=" in rank0.stdout
    assert "[rank 1] step 300/300" in rank1.stdout
    assert "[rank 1]" not in rank0.stdout

    got, ref = rank0_metrics(fleet, job), one_process_reference(tmp_path)
    assert got["world_size"] == 2 and got["steps"] == 300
    # Exact data parallelism (see tests/integration/test_train_ddp.py): within one test sample.
    assert abs(got["test_acc"] - ref["test_acc"]) <= 1 / ref["test_samples"] + 1e-12
    assert fleet.check() == []


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_killing_one_rank_retries_the_gang_from_the_checkpoint(fleet: Fleet) -> None:
    start_gang_agents(fleet)
    job_id = fleet.submit(
        {
            "name": "ddp-kill",
            "command": [sys.executable, SCRIPT, *ARGS, "--step-sleep", "0.05"],
            "gpu_count": 4,
            "nodes": 2,
            "gpus_per_node": 2,
            "max_retries": 2,
        }
    )
    place_if_waiting(fleet, job_id)
    with fleet.http() as c:
        fleet.wait_for(
            lambda: "step 60/300" in c.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1}).text,
            90,
            "rank 1 past step 60",
        )
    procs = rank_processes(job_id)
    assert set(procs) == {0, 1}, procs
    first = fleet.job(job_id)["attempts"]
    os.kill(procs[1], signal.SIGKILL)

    # The whole attempt is stopped: rank 0's process is gone too (verified, not assumed).
    fleet.wait_for(lambda: gone(procs[0]), 60, "rank 0 stopped after rank 1 died")
    fleet.wait_status(job_id, {"PENDING", "SUCCEEDED", "FAILED"}, 60)
    place_if_waiting(fleet, job_id, wait_s=30)  # the retry: one new gang attempt (backoff)
    done = fleet.wait_status(job_id, {"SUCCEEDED", "FAILED"}, 240)
    assert done["status"] == "SUCCEEDED", done
    attempts = done["attempts"]
    n_first = {a["attempt"] for a in first}
    last_no = max(a["attempt"] for a in attempts)
    assert last_no > max(n_first)
    old_tokens = [a["token"] for a in attempts if a["attempt"] in n_first]
    new_tokens = [a["token"] for a in attempts if a["attempt"] == last_no]
    assert new_tokens and min(new_tokens) > max(old_tokens)  # a new token on every member

    metrics = rank0_metrics(fleet, done)
    assert metrics["resumed_from_step"] is not None and metrics["resumed_from_step"] >= 60
    assert metrics["steps"] == 300
    with fleet.http() as c:
        assert "resumed from step" in c.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1}).text
    assert fleet.check() == []
