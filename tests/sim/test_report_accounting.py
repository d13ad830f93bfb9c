"""What the report counts: max_runtime_s enforced (TIMEOUT), queue delay over every job that
started (never-started jobs apart, censored), queue delay and backlog from eligibility (not
while held by a dependency or an array's %N), Jain's index undefined at 0/0 and the
entitlement of a team without a guarantee, and job counts that add up to the workload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from gpufleet.policy.config import PolicyConfig
from gpufleet.sim.cli import app, run_sim
from gpufleet.sim.engine import Engine, EngineOptions
from gpufleet.sim.metrics import jain
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

ONE_NODE = [NodeGroup("g", 1, 8, "A100")]


def _run(
    groups: list[NodeGroup],
    teams: list[TeamSpec],
    jobs: list[SimJob],
    horizon_s: float | None = None,
) -> tuple[Engine, dict[str, Any]]:
    eng = Engine(groups, teams, jobs, PolicyConfig(), EngineOptions(horizon_s=horizon_s))
    eng.run()
    return eng, eng.rec.report()


def _adds_up(rep: dict[str, Any], n_jobs: int) -> None:
    j = rep["jobs"]
    total = j["finished"] + j["rejected_never_fit"] + j["unfinished"]
    assert total + j["not_submitted_by_horizon"] == n_jobs, j


def test_max_runtime_s_ends_the_attempt_failed_timeout() -> None:
    """C (duration 1000 s, max_runtime_s 50) backfills into B's reservation on the strength
    of its bound: it is stopped at start + 50 s (+ grace), ends FAILED (timeout, not retried)
    and B starts at its reservation (waits 99 s; it waited 1001 s when the bound was not
    enforced)."""
    teams = [TeamSpec("a", guaranteed_gpus={"A100": 8})]
    jobs = [
        SimJob("A", "a", 0, 4, 100, expected_duration_s=100),
        SimJob("B", "a", 1, 8, 10, expected_duration_s=10),
        SimJob("C", "a", 2, 4, 1000, max_runtime_s=50),
    ]
    eng, rep = _run(ONE_NODE, teams, jobs)
    c = eng.fleet.jobs["C"]
    assert c.status.value == "FAILED" and c.timed_out
    assert c.end_s == 2 + 50 + eng.opt.grace_s
    assert len(c.runs) == 1
    assert eng.fleet.jobs["B"].first_start_s == 100
    assert rep["jobs"]["timed_out"] == 1
    assert rep["jobs"]["succeeded"] == 2
    assert rep["starvation"]["longest_wait_s"] == 99
    assert rep["jct_s"]["n"] == 2  # JCT is over the jobs that succeeded
    _adds_up(rep, 3)


def test_an_attempt_stopped_early_does_not_stretch_the_run() -> None:
    """A new user's run: a job of 100,000 s of work stopped at its 100 s bound made the run
    end at 100,000 s (its end event was still queued), and overall allocation read 8e-05.
    An ended attempt's queued events are dropped without moving the clock."""
    eng, rep = _run(
        ONE_NODE, [TeamSpec("a")], [SimJob("a", "a", 0, 1, 100_000, max_runtime_s=100)]
    )
    assert eng.now == 100 + eng.opt.grace_s
    assert eng.events == 3  # arrival, timeout, stop confirmed
    assert rep["allocation"]["overall"] == 1 / 8
    _adds_up(rep, 1)


def test_a_job_within_its_bound_is_not_timed_out() -> None:
    jobs = [SimJob("A", "a", 0, 4, 100, max_runtime_s=100)]
    eng, rep = _run(ONE_NODE, [TeamSpec("a", guaranteed_gpus={"A100": 8})], jobs)
    assert eng.fleet.jobs["A"].status.value == "SUCCEEDED"
    assert rep["jobs"]["timed_out"] == 0


def test_queue_delay_counts_every_started_job_and_never_started_apart() -> None:
    """At the horizon, b_long (8 GPUs) started after waiting 500 s but has not finished and
    c_waits never started (waited 300 s by the end): b_long's wait is in the statistics (they
    covered finished jobs only, so the longest wait was above the reported max), c_waits is
    counted apart with its censored wait."""
    teams = [TeamSpec("a", guaranteed_gpus={"A100": 8})]
    jobs = [
        SimJob("a_short", "a", 0, 8, 500),
        SimJob("b_long", "a", 0, 8, 10_000),
        SimJob("c_waits", "a", 700, 8, 100),
    ]
    _, rep = _run(ONE_NODE, teams, jobs, horizon_s=1000)
    qd = rep["queue_delay_s"]
    assert qd["all"]["n"] == 2 and qd["all"]["max"] == 500
    assert rep["jobs"]["started"] == 2
    assert rep["jobs"]["unfinished_never_started"] == 1
    assert qd["never_started_censored"]["n"] == 1
    assert qd["never_started_censored"]["max"] == 300
    assert rep["starvation"]["longest_wait_s"] == 500
    assert rep["starvation"]["max_wait_by_tier_s"]["NORMAL"] == 500
    _adds_up(rep, 3)


def test_time_held_by_dependency_or_array_limit_is_not_queue_delay() -> None:
    """A 32-GPU fleet left idle: 'second' waits for 'first' (afterok), array tasks run one at
    a time (%1). Nobody waits for GPUs: queue delay 0, no backlog; the held time is reported
    apart (it was counted as queue delay and backlog: mean 1167 s, backlog share 0.75)."""
    groups = [NodeGroup("g", 4, 8, "A100")]
    teams = [TeamSpec("a", guaranteed_gpus={"A100": 32})]
    jobs = [
        SimJob("first", "a", 0, 1, 1000),
        SimJob("second", "a", 0, 8, 10, depends_on=(("afterok", "first"),)),
        *(
            SimJob(f"arr_{i}", "a", 0, 1, 1000, array_id="arr", array_index=i, array_max_running=1)
            for i in range(4)
        ),
    ]
    _, rep = _run(groups, teams, jobs)
    assert rep["queue_delay_s"]["all"]["max"] == 0
    assert rep["starvation"]["longest_wait_s"] == 0
    assert rep["allocation"]["backlog_time_share"] == 0
    assert rep["allocation"]["under_backlog"] is None
    held = rep["queue_delay_s"]["held_by_dependency_or_limit"]
    assert held["n"] == 4 and held["max"] == 3000  # second 1000, arr_1..3 1000/2000/3000


def test_jain_is_undefined_when_every_backlogged_team_has_no_gpus() -> None:
    assert jain([0.0, 0.0]) is None
    assert jain([1.0, 1.0]) == 1.0
    teams = [
        TeamSpec("a", guaranteed_gpus={"A100": 4}),
        TeamSpec("b", guaranteed_gpus={"A100": 4}),
        TeamSpec("c"),
    ]
    jobs = [
        SimJob("c1", "c", 0, 8, 1000, preemptible=False),
        SimJob("a1", "a", 1, 4, 10),
        SimJob("b1", "b", 1, 4, 10),
    ]
    _, rep = _run(ONE_NODE, teams, jobs)
    assert rep["fairness"]["jain_backlogged_time_weighted"] is None
    assert rep["fairness"]["share_of_time_two_or_more_teams_backlogged"] > 0.9


def test_entitlement_of_a_team_without_guarantee() -> None:
    """A team without a guarantee is entitled to its weighted share of the GPUs no guarantee
    covers (it was its weight, 1.0, as GPUs); none when the guarantees cover the fleet."""
    groups = [NodeGroup("g", 4, 8, "A100")]
    teams = [
        TeamSpec("a", guaranteed_gpus={"A100": 16}),
        TeamSpec("b", weight=1.0),
        TeamSpec("c", weight=3.0),
    ]
    eng = Engine(groups, teams, [], PolicyConfig())
    assert eng.teams_entitlement() == {"a": 16.0, "b": 4.0, "c": 12.0}
    full = Engine(
        groups, [TeamSpec("a", guaranteed_gpus={"A100": 32}), TeamSpec("b")], [], PolicyConfig()
    )
    assert full.teams_entitlement() == {"a": 32.0, "b": 0.0}
    # a team only the workload names (no spec) is a team without a guarantee
    eng2, rep = _run(
        groups, [TeamSpec("a", guaranteed_gpus={"A100": 16})], [SimJob("x", "z", 0, 1, 10)]
    )
    assert rep["per_team"]["z"]["entitlement_gpus"] == 16.0
    assert eng2.rec.entitlement == {"a": 16.0, "z": 16.0}


def test_jobs_after_the_horizon_are_counted(tmp_path: Path) -> None:
    """j2 arrives after the horizon: it is counted (not_submitted_by_horizon), so the counts
    add up to the workload (finished + never_fit + unfinished was 1 of 2)."""
    cfg = tmp_path / "h.yaml"
    cfg.write_text(
        """
name: t
cluster:
  node_groups:
    - {name: g, count: 2, gpus_per_node: 8, gpu_type: A100}
teams:
  - {id: a, guaranteed_gpus: {A100: 8}}
  - {id: b, guaranteed_gpus: {A100: 8}}
workload:
  jobs:
    - {id: j1, team: a, submit_s: 0, gpus: 4, duration_s: 100}
    - {id: j2, team: b, submit_s: 10, gpus: 8, duration_s: 200}
engine: {horizon_h: 0.001}
""",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "not_submitted=1" in result.output
    rep = json.loads((out / "report.json").read_text(encoding="utf-8"))
    run = rep["runs"]["main"]
    assert run["jobs"]["not_submitted_by_horizon"] == 1
    _adds_up(run, rep["jobs_in_workload"])


def test_html_jobs_started_is_the_started_count(tmp_path: Path) -> None:
    """The HTML table's "jobs started" showed the finished count: at the horizon one job has
    finished, two have started and one never started."""
    cfg = tmp_path / "s.yaml"
    cfg.write_text(
        """
name: s
cluster:
  node_groups: [{name: g, count: 1, gpus_per_node: 8, gpu_type: A100}]
teams: [{id: a, guaranteed_gpus: {A100: 8}}]
workload:
  jobs:
    - {id: a_short, team: a, submit_s: 0, gpus: 8, duration_s: 500}
    - {id: b_long, team: a, submit_s: 0, gpus: 8, duration_s: 10000}
    - {id: c_waits, team: a, submit_s: 700, gpus: 8, duration_s: 100}
engine: {horizon_h: 0.5}
""",
        encoding="utf-8",
    )
    rep = run_sim(cfg, tmp_path / "out", seed=1, compare=())
    page = (tmp_path / "out" / rep["html"]).read_text(encoding="utf-8")
    assert "<th>jobs started</th><th>never started by the end</th>" in page
    assert "<tr><td>main</td><td>2</td><td>1</td>" in page
