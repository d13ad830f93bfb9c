"""Scheduler metrics against the database after a scripted scenario on a live platform:
submit, run, reclaim, priority preemption, cancel. The scrape is the API server's
``/metrics`` (controller and API share the process, as in ``gpufleet up``); the values must
converge to what the database says (the gauges come from the leader's last pass)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from functools import partial
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from gpufleet.controller.metrics import gpu_bucket
from gpufleet.domain.states import JobStatus, RunStatus
from gpufleet.services import auth
from gpufleet.store.tables import JobRow, JobRunRow, NodeCapacityRow, SchedulingEventRow
from tests.e2e.harness import Fleet
from tests.ports import free_port

pytestmark = pytest.mark.slow

ACTIVE = [RunStatus.ASSIGNED, RunStatus.RUNNING, RunStatus.PREEMPTING]


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted label pairs -> value} for every sample of ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def from_database(fleet: Fleet) -> dict[str, Any]:
    with fleet.db.read() as s:
        allocated: Counter[str] = Counter()
        for team, gpu_ids in s.execute(
            select(JobRow.team_id, JobRunRow.gpu_ids)
            .join(JobRow, JobRow.id == JobRunRow.job_id)
            .where(JobRunRow.status.in_(ACTIVE))
        ):
            allocated[team] += len(gpu_ids)
        depth: Counter[tuple[str, str, str]] = Counter()
        for team, priority, gpus in s.execute(
            select(JobRow.team_id, JobRow.priority, JobRow.gpu_count).where(
                JobRow.status == JobStatus.PENDING,
                JobRow.cancel_requested.is_(False),
                JobRow.retry_after.is_(None),
            )
        ):
            depth[(team, priority, gpu_bucket(gpus))] += 1
        preempted: Counter[str] = Counter()
        for (message,) in s.execute(
            select(SchedulingEventRow.message).where(
                SchedulingEventRow.machine == "run",
                SchedulingEventRow.to_status == RunStatus.PREEMPTING,
                SchedulingEventRow.message.like("preempted for %"),
            )
        ):
            preempted[str(message).rsplit("(", 1)[-1].rstrip(")")] += 1
        free = s.execute(select(func.sum(NodeCapacityRow.available_gpus))).scalar_one()
        stopping = s.execute(
            select(func.count()).where(JobRunRow.status.in_([RunStatus.PREEMPTING]))
        ).scalar_one()
    return {
        "allocated": {t: n for t, n in allocated.items() if n},
        "depth": dict(depth),
        "preempted": dict(preempted),
        "free": int(free or 0),
        "stopping": int(stopping),
    }


def from_metrics(m: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, Any]:
    allocated = {
        dict(k)["team"]: int(v)
        for k, v in m.get("gpufleet_team_gpus", {}).items()
        if dict(k)["kind"] == "allocated" and v
    }
    depth = {
        (dict(k)["team"], dict(k)["priority"], dict(k)["gpus"]): int(v)
        for k, v in m.get("gpufleet_queue_depth_jobs", {}).items()
        if v
    }
    preempted = {
        dict(k)["reason"]: int(v) for k, v in m.get("gpufleet_preemptions_total", {}).items() if v
    }
    free = sum(int(v) for k, v in m.get("gpufleet_gpus", {}).items() if dict(k)["use"] == "free")
    return {"allocated": allocated, "depth": depth, "preempted": preempted, "free": free}


def baseline_preemptions() -> dict[str, int]:
    """Counters are per process: earlier tests in this process may have counted some."""
    from gpufleet.controller import metrics

    return {
        reason: int(metrics.PREEMPTIONS.labels(reason)._value.get())
        for reason in ("reclaim", "priority")
    }


def baseline_starts() -> dict[str, float]:
    """Time-to-start observations per image label so far in this process (earlier tests in
    this xdist worker, container tests among them, may have observed warm/cold starts)."""
    from gpufleet.controller import metrics

    out: dict[str, float] = {}
    for family in metrics.TIME_TO_START.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                image = sample.labels["image"]
                out[image] = out.get(image, 0.0) + sample.value
    return out


def test_scraped_values_equal_the_database_after_preempt_reclaim_cancel(
    tmp_path: Any,
) -> None:
    before = baseline_preemptions()
    starts_before = baseline_starts()
    fleet = Fleet(tmp_path, scheduler_tick_s=0.2, grace_s=1.0).start()
    try:
        marker = f"gpufleet-test-marker-{fleet.tmp.name}"
        sleep = [sys.executable, "-c", "import time; time.sleep(600)", marker]
        admin = fleet.db.run_write(
            partial(auth.create_token, team_id="ops", is_admin=True, create_team_if_missing=True)
        )
        r = httpx.put(
            f"{fleet.api.url}/v1/admin/teams/vision",
            json={"guaranteed_gpus": {"H100": 2}},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert r.status_code == 200, r.text
        agent_port = free_port()
        fleet.start_agent(
            "node-a", gpus="4xH100-80GB", env={"GPUFLEET_AGENT_METRICS_PORT": str(agent_port)}
        )

        # nlp borrows the whole node with two LOW jobs
        low = [
            fleet.submit({"command": sleep, "gpu_count": 2, "priority": "LOW"}, team="nlp")
            for _ in range(2)
        ]
        for j in low:
            fleet.wait_status(j, {"RUNNING"}, 30, team="nlp")
        # vision takes its guarantee back: one nlp job is reclaimed
        mine = fleet.submit({"command": sleep, "gpu_count": 2})
        fleet.wait_status(mine, {"RUNNING"}, 60)
        # a HIGH nlp job displaces nlp's remaining LOW job (same team, strictly lower)
        high = fleet.submit({"command": sleep, "gpu_count": 2, "priority": "HIGH"}, team="nlp")
        fleet.wait_status(high, {"RUNNING"}, 60, team="nlp")
        # both LOW jobs are back in the queue; one is cancelled there
        for j in low:
            fleet.wait_status(j, {"PENDING"}, 30, team="nlp")
        with fleet.http("nlp") as c:
            assert c.delete(f"/v1/jobs/{low[0]}").status_code == 202
        fleet.wait_status(low[0], {"CANCELLED"}, 10, team="nlp")
        # one more waiting job of another size bucket
        fleet.submit({"command": sleep, "gpu_count": 1}, team="vision")

        deadline = time.monotonic() + 20
        while True:
            db = from_database(fleet)
            scraped = from_metrics(scrape(fleet.api.url))
            scraped["preempted"] = {
                reason: n - before.get(reason, 0)
                for reason, n in scraped["preempted"].items()
                if n - before.get(reason, 0)
            }
            if (
                db["stopping"] == 0
                and all(scraped[k] == db[k] for k in ("allocated", "depth", "preempted", "free"))
            ) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert scraped["allocated"] == db["allocated"] == {"vision": 2, "nlp": 2}
        assert scraped["depth"] == db["depth"]
        assert db["depth"] == {("nlp", "LOW", "2"): 1, ("vision", "NORMAL", "1"): 1}
        assert scraped["preempted"] == db["preempted"] == {"reclaim": 1, "priority": 1}
        assert scraped["free"] == db["free"] == 0

        m = scrape(fleet.api.url)
        # the queue-age histogram counts exactly the queued jobs
        counts = {
            (dict(k)["team"], dict(k)["priority"], dict(k)["gpus"]): int(v)
            for k, v in m["gpufleet_queue_age_seconds_gcount"].items()
        }
        assert {k: v for k, v in counts.items() if v} == db["depth"]
        assert m["gpufleet_leader"][()] == 1
        assert m["gpufleet_leader_epoch"][()] >= 1
        assert 0 <= m["gpufleet_leader_lease_age_seconds"][()] < 30
        assert sum(m["gpufleet_scheduler_pass_duration_seconds_count"].values()) > 0
        # team borrowed = allocated above guarantee: vision within its 2, nlp borrows 2
        borrowed = {
            dict(k)["team"]: int(v)
            for k, v in m["gpufleet_team_gpus"].items()
            if dict(k)["kind"] == "borrowed"
        }
        assert borrowed.get("vision") == 0 and borrowed.get("nlp") == 2
        fits = {dict(k)["gpu_type"]: v for k, v in m["gpufleet_largest_fitting_job_gpus"].items()}
        assert fits == {"H100": 0}
        starts: dict[str, float] = {}
        for k, v in m["gpufleet_time_to_start_seconds_count"].items():
            image = dict(k)["image"]
            starts[image] = starts.get(image, 0.0) + v
        new = {i: n - starts_before.get(i, 0.0) for i, n in starts.items()}
        assert sum(new.values()) >= 4, new
        # this scenario's starts are host processes: "none" from the phases the node reported,
        # "unknown" where a start was observed without them; never warm/cold
        labels = {i for i, n in new.items() if n > 0}
        assert "none" in labels and labels <= {"none", "unknown"}, (labels, starts_before)

        # the agent's own target: what it holds, its heartbeats, its uploads, its disk
        agent_url = f"http://127.0.0.1:{agent_port}"
        # (an answered heartbeat is needed for an RTT sample: on a loaded machine the first
        # ones may time out, so wait for one rather than take the first scrape)
        deadline = time.monotonic() + 30
        while True:
            a = scrape(agent_url)
            ready = (
                a["gpufleet_agent_running_attempts"][()] == 2
                and a["gpufleet_agent_heartbeat_rtt_seconds_count"][()] > 0
            )
            if ready or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert a["gpufleet_agent_running_attempts"][()] == 2  # vision's and nlp's HIGH job
        assert a["gpufleet_agent_free_gpus"][()] == 0
        assert a["gpufleet_agent_info"][(("agent_epoch", "1"), ("node_id", "node-a"))] == 1
        assert a["gpufleet_agent_heartbeat_rtt_seconds_count"][()] > 0
        assert a["gpufleet_agent_upload_bytes_total"][()] > 0  # the preempted attempts' logs
        assert all(v > 0 for v in a["gpufleet_agent_disk_free_bytes"].values())
    finally:
        fleet.stop()
