"""The Grafana dashboard and the Prometheus example name only metrics gpufleet exports, and
the leader's state gauges hold what a snapshot says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

from gpufleet.agent import metrics as agent_metrics
from gpufleet.api import app as api_app
from gpufleet.controller import metrics
from gpufleet.domain.types import PriorityClass, Resources
from gpufleet.policy.decisions import CycleResult, HoldForBackfill
from gpufleet.policy.snapshot import (
    ClusterSnapshot,
    GpuHold,
    NodeState,
    PendingJob,
    RunningJob,
    TeamState,
)
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/gpufleet.json"
METRIC = re.compile(r"\bgpufleet_[a-z0-9_]+\b")


def snapshot() -> ClusterSnapshot:
    nodes = (
        NodeState("n1", "H100", 80_000, 8, free_gpus=3),
        NodeState("n2", "H100", 80_000, 8, free_gpus=8),
        # fenced: 2 GPUs of a fenced attempt are still QUARANTINED, nothing runs
        NodeState("n3", "A100", 40_000, 4, free_gpus=2, schedulable=False, status="FENCED"),
    )
    pending = (
        PendingJob("j1", "vision", PriorityClass.NORMAL, 900.0, Resources(1)),
        PendingJob("j2", "vision", PriorityClass.NORMAL, 400.0, Resources(3)),
        PendingJob("j3", "nlp", PriorityClass.HIGH, 990.0, Resources(16, nodes=2)),
    )
    running = (
        RunningJob("r1", "a", "vision", "n1", PriorityClass.NORMAL, 4, "H100", 0.0),
        RunningJob("r2", "b", "nlp", "n1", PriorityClass.LOW, 1, "H100", 0.0),
    )
    teams = {
        "vision": TeamState("vision", guaranteed_gpus={"H100": 2}, usage_gpu_s=3600.0),
        "nlp": TeamState("nlp", weight=2.0),
    }
    return ClusterSnapshot(
        now_s=1000.0,
        nodes=nodes,
        pending=pending,
        running=running,
        teams=teams,
        holds=(GpuHold("j3", "n2", 8, 990.0, "priority"),),
    )


def exported_names() -> set[str]:
    """Every sample name the process serves (after a pass published its state)."""
    assert agent_metrics.UPLOAD_BYTES is not None and api_app.SUBMITS is not None
    snap = snapshot()
    metrics.publish(metrics.fleet_view(snap, None))
    names: set[str] = set()
    for family in [*REGISTRY.collect(), *agent_metrics.REGISTRY.collect()]:
        names.add(family.name)
        names.update(s.name for s in family.samples)
        # a labelled histogram nobody observed yet has no samples: its series names
        if family.type in ("histogram", "gaugehistogram"):
            names.update(f"{family.name}{sfx}" for sfx in ("_bucket", "_count", "_sum"))
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def test_every_dashboard_query_names_an_exported_metric() -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
    assert len(exprs) >= 30
    used = {m for e in exprs for m in METRIC.findall(e)}
    missing = used - exported_names()
    assert not missing, f"dashboard queries name metrics nobody exports: {sorted(missing)}"
    titles = {p["title"] for p in board["panels"] if p["type"] == "row"}
    assert titles == {"Fleet", "Teams", "Queue tails", "Fragmentation", "Control plane"}
    for p in board["panels"]:
        if p["type"] != "row":
            assert (
                p["datasource"]["uid"] == "${datasource}" and p["fieldConfig"]["defaults"]["unit"]
            )


def test_the_dashboard_file_is_what_the_generator_writes() -> None:
    import runpy

    gen = runpy.run_path(str(ROOT / "deploy/grafana/generate.py"))
    assert json.loads(DASHBOARD.read_text()) == gen["dashboard"]()


def test_prometheus_example_scrapes_api_controller_and_agents() -> None:
    conf = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"] for j in conf["scrape_configs"]}
    assert {"gpufleet-api", "gpufleet-controller", "gpufleet-agent"} <= jobs


def test_state_gauges_from_a_snapshot() -> None:
    snap = snapshot()
    result = CycleResult(decisions=(HoldForBackfill("j2", "n2", 3, 1500.0),))
    view = metrics.fleet_view(snap, result)
    assert view.queue_depth == {
        ("vision", "NORMAL", "1"): 1,
        ("vision", "NORMAL", "4"): 1,
        ("nlp", "HIGH", "gang"): 1,
    }
    assert sorted(view.queue_age[("vision", "NORMAL", "4")]) == [600.0]
    assert view.gpus[("H100", "HEALTHY", "allocated")] == 5
    assert view.gpus[("H100", "HEALTHY", "free")] == 11
    assert view.gpus[("A100", "FENCED", "quarantined")] == 2
    assert view.gpus[("A100", "FENCED", "allocated")] == 0
    assert view.held == {("H100", "priority"): 8, ("H100", "backfill"): 3}
    assert view.free_per_node == {"H100": [3, 8]}
    assert view.largest_fit == {"H100": 8, "A100": 0}
    assert view.team_gpus[("vision", "H100", "allocated")] == 4
    assert view.team_gpus[("vision", "H100", "borrowed")] == 2
    assert view.team_gpus[("nlp", "H100", "borrowed")] == 1
    assert view.team_usage["vision"] == 3600.0
    # DRF: 4 of 16 H100s for vision (weight 1); 1 of 16 for nlp at weight 2
    assert view.team_share["vision"] == 0.25
    assert view.team_share["nlp"] == 1 / 16 / 2


def test_histogram_buckets_are_cumulative() -> None:
    buckets, total = metrics._buckets([0.0, 3.0, 8.0], metrics.FREE_GPU_BUCKETS)
    got = dict(buckets)
    assert got["0.0"] == 1 and got["2.0"] == 1 and got["3.0"] == 2 and got["8.0"] == 3
    assert got["+Inf"] == 3 and total == 11.0


def test_size_buckets() -> None:
    assert [metrics.gpu_bucket(n) for n in (1, 2, 3, 4, 5, 8, 16)] == [
        "1",
        "2",
        "4",
        "4",
        "8",
        "8",
        "8",
    ]
    assert metrics.size_bucket(Resources(16, nodes=2)) == "gang"
    assert metrics.size_bucket(Resources(8, nodes=1)) == "8"


def test_node_status_changes_between_passes_are_counted() -> None:
    from dataclasses import replace

    snap = snapshot()
    result = CycleResult(decisions=())
    metrics.note_lease(7)  # a (new) leadership: no previous pass to compare with
    counter = metrics.NODE_STATUS_CHANGES.labels("HEALTHY", "SUSPECT")
    before = counter._value.get()
    metrics.observe_pass(snap, result, (), seconds=0.0, conflicts=0)
    assert counter._value.get() == before
    suspect = replace(snap, nodes=(replace(snap.nodes[0], status="SUSPECT"), *snap.nodes[1:]))
    metrics.observe_pass(suspect, result, (), seconds=0.0, conflicts=0)
    metrics.observe_pass(suspect, result, (), seconds=0.0, conflicts=0)
    assert counter._value.get() == before + 1
    metrics.note_lease(0)
    assert metrics._published.current() is None  # a follower serves no state


def test_agent_metrics_only_on_the_agents_port_not_in_the_api_process() -> None:

    import httpx
    from prometheus_client import generate_latest

    import gpufleet.agent.service  # noqa: F401  (what an API/controller process may import)

    agent_metrics.note_heartbeat(3, 5, {"/state": 7})
    # what the API's GET /metrics serves: the default registry
    assert b"gpufleet_agent_" not in generate_latest()
    port = free_port()
    agent_metrics.serve(port, "127.0.0.1")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "gpufleet_agent_running_attempts 3.0" in text
    assert "gpufleet_agent_free_gpus 5.0" in text
    assert "process_cpu_seconds_total" in text or "python_info" in text
