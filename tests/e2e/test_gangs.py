"""Multi-node (gang) jobs through real agents and real job processes: two agents on this
machine with 2 declared GPUs each, one 2 x 2-GPU gang.

The gang is placed here with a ``PlaceGang`` decision applied through the live scheduler
(``Scheduler._place_gang``: the same reserve-all-or-none transaction and dispatch a pass
uses); once the gang-aware policy is merged it may place the job itself first, which these
tests accept. Everything after the placement is the platform's own doing: rank 0's agent
picking MASTER_PORT, the other rank assigned with it, confirmations, the whole-gang stop,
the retry, preemption."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

import pytest

from gpufleet.agent.procfs import read_stat
from gpufleet.controller.scheduler import PassStats
from gpufleet.domain.errors import CapacityConflict, StaleState
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.decisions import GangMember, PlaceGang, Preempt
from gpufleet.store.tables import JobRow
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)]

# argv: [-c, marker, pid_dir, mode]; mode "sleep" makes attempt 1 sleep (to be killed or
# preempted); otherwise the ranks meet over TCP at MASTER_ADDR:MASTER_PORT (a rendezvous
# like torch.distributed's), rank 0 writes what it heard as an artifact, and all exit 0
GANG = r"""
import json, os, socket, sys, time
keys = ["RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "GPUFLEET_GANG_SIZE", "GPUFLEET_NNODES", "GPUFLEET_NODE_RANK",
        "GPUFLEET_GPUS_PER_NODE", "GPUFLEET_WORLD_GPUS", "PET_NNODES", "PET_NODE_RANK",
        "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT", "CUDA_VISIBLE_DEVICES",
        "GPUFLEET_ATTEMPT", "GPUFLEET_FENCING_TOKEN"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}, sort_keys=True), flush=True)
rank, attempt = int(os.environ["RANK"]), os.environ["GPUFLEET_ATTEMPT"]
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
open(os.path.join(sys.argv[2], f"pid-{attempt}-{rank}"), "w").write(str(os.getpid()))
if sys.argv[3] == "sleep" and attempt == "1":
    time.sleep(600)
if rank == 0:
    srv = socket.create_server((addr, port))
    srv.settimeout(60)
    heard = []
    for _ in range(int(os.environ["WORLD_SIZE"]) - 1):
        conn, _ = srv.accept()
        heard.append(conn.recv(64).decode())
        conn.close()
    out = os.path.join(os.environ["GPUFLEET_ARTIFACTS_DIR"], "gang.txt")
    open(out, "w").write(",".join(sorted(heard)))
    print("rank 0 heard", heard, flush=True)
else:
    for _ in range(300):
        try:
            conn = socket.create_connection((addr, port), timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    conn.sendall(f"rank{rank}".encode())
    conn.close()
    print(f"rank {rank} reached rank 0 at {addr}:{port}", flush=True)
"""


def gang_job(fleet: Fleet, mode: str, **extra: Any) -> str:
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    pids = fleet.tmp / "pids"
    pids.mkdir(exist_ok=True)
    body = {
        "command": [sys.executable, "-c", GANG, marker, str(pids), mode],
        "nodes": 2,
        "gpus_per_node": 2,
        "priority": "LOW",
        **extra,
    }
    return fleet.submit(body)


def place(fleet: Fleet, job_id: str, nodes: tuple[str, ...] = ("a1", "a2")) -> None:
    """Apply PlaceGang through the live scheduler (unless a gang-aware policy placed the
    job first), then wait for RUNNING."""
    with fleet.db.read() as s:
        row = s.get(JobRow, job_id)
        assert row is not None
        seen, status = row.fencing_epoch, row.status
    if status == "PENDING":
        decision = PlaceGang(job_id, tuple(GangMember(i, n, 2) for i, n in enumerate(nodes)))
        with contextlib.suppress(StaleState, CapacityConflict):  # placed by the policy
            fleet.controller.scheduler._place_gang(decision, seen, PassStats())
    fleet.wait_status(job_id, {"RUNNING", *TERMINAL}, timeout_s=30)


def alive(pid: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.state not in "ZX"


def pid_of(fleet: Fleet, attempt: int, rank: int) -> int:
    path = fleet.tmp / "pids" / f"pid-{attempt}-{rank}"
    fleet.wait_for(lambda: path.exists() and path.read_text(), 20, str(path))
    return int(path.read_text())


def log(fleet: Fleet, job_id: str, rank: int) -> str:
    with fleet.http() as c:
        r = c.get(f"/v1/jobs/{job_id}/logs", params={"rank": rank})
        assert r.status_code == 200, r.text
        return r.text


def env_of(text: str) -> dict[str, str]:
    line = next(x for x in text.splitlines() if x.startswith("ENV "))
    return dict(json.loads(line[4:]))


def test_a_two_by_two_gang_runs_with_the_distributed_env_and_succeeds_once(
    fleet: Fleet,
) -> None:
    fleet.start_agent("a1", gpus="2xH100-80GB")
    fleet.start_agent("a2", gpus="2xH100-80GB")
    fleet.start_sampling()
    job_id = gang_job(fleet, "rendezvous")
    place(fleet, job_id)
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert job["status"] == "SUCCEEDED", job
    assert (job["nodes"], job["gpus_per_node"], job["gpu_count"]) == (2, 2, 4)
    members = job["attempts"]
    assert sorted((m["rank"], m["gang_size"], m["node_id"]) for m in members) == [
        (0, 2, "a1"),
        (1, 2, "a2"),
    ]
    assert {m["token"] for m in members} == {1} and {m["status"] for m in members} == {"SUCCEEDED"}
    rank0 = next(m for m in members if m["rank"] == 0)
    assert job["result_uri"] == rank0["manifest_uri"]
    envs = {r: env_of(log(fleet, job_id, r)) for r in (0, 1)}
    for r, env in envs.items():
        assert env["RANK"] == env["NODE_RANK"] == env["GPUFLEET_NODE_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["GPUFLEET_GANG_SIZE"] == env["PET_NNODES"] == "2"
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1")
        assert env["GPUFLEET_GPUS_PER_NODE"] == env["PET_NPROC_PER_NODE"] == "2"
        assert env["GPUFLEET_WORLD_GPUS"] == "4" and env["GPUFLEET_FENCING_TOKEN"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert env["PET_MASTER_PORT"] == env["MASTER_PORT"]
    assert "rank 0 heard ['rank1']" in log(fleet, job_id, 0)
    assert "reached rank 0" in log(fleet, job_id, 1)
    store = ObjectStore(fleet.settings.resolved_object_store_url())
    manifest = json.loads(store.get_bytes(store.key_of(job["result_uri"])))
    artifact = next(f for f in manifest["files"] if f["key"].endswith("gang.txt"))
    assert store.get_bytes(artifact["key"]) == b"rank1"
    with fleet.http() as c:
        missing = c.get(f"/v1/jobs/{job_id}/logs", params={"rank": 2})
    assert missing.status_code == 404 and missing.json()["field"] == "rank"
    assert fleet.violations == [] and fleet.check() == []
    nodes = fleet.get("/v1/nodes")["items"]
    assert [(n["node_id"], n["available_gpus"]) for n in nodes] == [("a1", 2), ("a2", 2)]


def test_killing_one_rank_stops_the_other_and_retries_the_gang_with_a_new_token(
    fleet: Fleet,
) -> None:
    fleet.start_agent("a1", gpus="2xH100-80GB")
    fleet.start_agent("a2", gpus="2xH100-80GB")
    fleet.start_sampling()
    job_id = gang_job(fleet, "sleep", max_retries=1)
    place(fleet, job_id)
    rank0, rank1 = pid_of(fleet, 1, 0), pid_of(fleet, 1, 1)
    assert alive(rank0) and alive(rank1)
    os.kill(rank1, signal.SIGKILL)
    fleet.wait_for(lambda: not alive(rank0), 30, "rank 0 stopped with its gang")

    def first_attempt_ended() -> bool:
        members = [m for m in fleet.job(job_id)["attempts"] if m["attempt"] == 1]
        return all(m["status"] in ("SUCCEEDED", "FAILED", "PREEMPTED") for m in members)

    fleet.wait_for(first_attempt_ended, 30, "every member of attempt 1 to end")
    job = fleet.job(job_id)  # PENDING (a gang-aware policy may place the retry after backoff)
    assert job["status"] in ("PENDING", "SCHEDULED", "RUNNING"), job
    first = {m["rank"]: m for m in job["attempts"] if m["attempt"] == 1}
    assert first[1]["status"] == "FAILED" and first[1]["exit_code"] != 0
    assert (first[0]["status"], first[0]["stop_reason"]) == ("FAILED", "gang")
    place(fleet, job_id)  # the retry: ONE new gang attempt
    job = fleet.wait_status(job_id, TERMINAL, timeout_s=60)
    assert job["status"] == "SUCCEEDED", job
    tokens = sorted((m["attempt"], m["rank"], m["token"]) for m in job["attempts"])
    assert tokens == [(1, 0, 1), (1, 1, 1), (2, 0, 2), (2, 1, 2)]
    assert env_of(log(fleet, job_id, 1))["GPUFLEET_FENCING_TOKEN"] == "2"
    assert fleet.violations == [] and fleet.check() == []


def test_preempting_a_gang_member_stops_the_whole_gang_before_its_gpus_are_reused(
    fleet: Fleet,
) -> None:
    fleet.start_agent("a1", gpus="2xH100-80GB")
    fleet.start_agent("a2", gpus="2xH100-80GB")
    fleet.start_sampling()
    job_id = gang_job(fleet, "sleep")
    place(fleet, job_id)
    pids = [pid_of(fleet, 1, 0), pid_of(fleet, 1, 1)]
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    check = (  # the preemptor looks for the gang's processes the moment it starts
        "import os, sys; pids = [int(p) for p in sys.argv[2].split(',')];"
        "st = lambda p: open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0];"
        "ok = lambda p: os.path.exists(f'/proc/{p}') and st(p) != 'Z';"
        "print('gang alive:', [p for p in pids if ok(p)], flush=True)"
    )
    critical = fleet.submit(
        {
            "command": [sys.executable, "-c", check, marker, ",".join(map(str, pids))],
            "gpu_count": 2,
            "priority": "CRITICAL",
        }
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the policy preempts on its own (priority)...
        if any(m["status"] != "RUNNING" for m in fleet.job(job_id)["attempts"]):
            print("the policy preempted the gang")
            break
        time.sleep(0.2)
    else:  # ...or the Preempt decision is applied through the live driver here
        member = next(m for m in fleet.job(job_id)["attempts"] if m["rank"] == 1)
        decision = Preempt(critical, member["node_id"], (member["run_id"],), "priority", 2)
        fleet.controller.scheduler._preempt(decision, PassStats())
        print("Preempt applied through the live driver")
    done = fleet.wait_status(critical, TERMINAL, timeout_s=60)
    assert done["status"] == "SUCCEEDED", done
    with fleet.http() as c:
        said = c.get(f"/v1/jobs/{critical}/logs").text
    # the invariant is per GPU: the member on the preemptor's node is gone before it starts
    # (each member's GPUs come back on its own agent's report, issue 24 item 3)
    where = done["attempts"][-1]["node_id"]
    rank = next(m["rank"] for m in fleet.job(job_id)["attempts"] if m["node_id"] == where)
    seen = said.split("gang alive: ", 1)[1].splitlines()[0]
    assert str(pids[rank]) not in seen, said
    gang = fleet.job(job_id)  # requeued (a gang-aware policy may place it again meanwhile)
    assert gang["status"] != "FAILED" and gang["status"] != "CANCELLED", gang
    assert {m["status"] for m in gang["attempts"] if m["attempt"] == 1} == {"PREEMPTED"}
    assert not any(alive(p) for p in pids)
    assert fleet.violations == [] and fleet.check() == []


# argv: [-c, marker, pid_dir, go_file]: each rank writes its pid, then waits for go_file and
# exits 0 (the gang's work is done the moment the test creates it)
UNTIL_GO = r"""
import os, sys, time
open(os.path.join(sys.argv[2], f"pid-1-{os.environ['RANK']}"), "w").write(str(os.getpid()))
while not os.path.exists(sys.argv[3]):
    time.sleep(0.1)
"""


@pytest.mark.fleet_settings(fence_timeout_s=25.0, suspect_after_missed=2)
def test_a_finished_member_frees_its_gpus_while_a_frozen_member_awaits_the_fence(
    fleet: Fleet,
) -> None:
    """Issue 24 item 3: the gang ends its work while one member's agent is frozen (SIGSTOP).
    The other member's GPUs come back on its own agent's report, and a waiting job starts on
    them before the frozen node is fenced; a job still waiting is told that the silent
    node's GPUs are held until its fence, not that running jobs have no max_runtime_s."""
    fleet.start_agent("a1", gpus="2xH100-80GB")
    fleet.start_agent("a2", gpus="2xH100-80GB")
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    pids, go = fleet.tmp / "pids", fleet.tmp / "go"
    pids.mkdir()
    gang = fleet.submit(
        {
            "command": [sys.executable, "-c", UNTIL_GO, marker, str(pids), str(go)],
            "nodes": 2,
            "gpus_per_node": 2,
            "priority": "LOW",
        }
    )
    place(fleet, gang)
    pid_of(fleet, 1, 0), pid_of(fleet, 1, 1)
    frozen = next(m["node_id"] for m in fleet.job(gang)["attempts"] if m["rank"] == 1)
    healthy = "a1" if frozen == "a2" else "a2"
    fleet.signal_agent(frozen, signal.SIGSTOP)
    frozen_at = time.monotonic()
    go.touch()  # both ranks exit 0; only the healthy node's agent can say so
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", marker]
    first = fleet.submit({"command": sleeper, "gpu_count": 2, "priority": "LOW"})
    second = fleet.submit({"command": sleeper, "gpu_count": 2, "priority": "LOW"})
    started = fleet.wait_status(first, {"RUNNING"}, timeout_s=15)
    assert started["attempts"][-1]["node_id"] == healthy
    elapsed = time.monotonic() - frozen_at
    members = {m["rank"]: m["status"] for m in fleet.job(gang)["attempts"]}
    assert members == {0: "SUCCEEDED", 1: "RUNNING"}, members  # not fenced yet
    assert elapsed < fleet.settings.fence_timeout_s, elapsed

    said: dict[str, Any] = {}

    def names_the_silent_node() -> bool:
        said.update(fleet.job(second).get("pending_reason") or {})
        return f"on {frozen} are held by job(s) {gang}" in str(said.get("message"))

    fleet.wait_for(names_the_silent_node, 15, f"{second}'s reason to name {frozen}")
    message = str(said["message"])
    assert "SUSPECT" in message and "until its fence in " in message, message
    (detail,) = said["details"]["unreachable"]
    assert (detail["node"], detail["held_gpus"], detail["jobs"]) == (frozen, 2, [gang])
    assert detail["fence_at_s"] is not None
    assert time.monotonic() - frozen_at < fleet.settings.fence_timeout_s
    assert fleet.job(second)["status"] == "PENDING"
    fleet.signal_agent(frozen, signal.SIGCONT)  # its report ends the gang, once
    assert fleet.wait_status(gang, TERMINAL, timeout_s=20)["status"] == "SUCCEEDED"
    assert fleet.wait_status(second, {"RUNNING"}, timeout_s=15)["attempts"][-1]["node_id"] == (
        frozen
    )
    assert fleet.check() == []
