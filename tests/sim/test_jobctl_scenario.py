"""Arrays and dependencies in the simulator's scenario format (``workload.jobs``), driven
through the same ``policy.gates`` as the live scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.sim.config import ScenarioError, load_scenario
from gpufleet.sim.engine import Engine

SCENARIO = """
name: jobctl
cluster:
  node_groups:
    - {name: n, count: 1, gpus_per_node: 8, gpu_type: H100, gpu_memory_mb: 81920}
teams:
  - {id: a, weight: 1}
workload:
  jobs:
    - {id: sweep, team: a, gpus: 1, duration_s: 100, array: "0-19%3"}
    - {id: prep, team: a, gpus: 1, duration_s: 50}
    - {id: train, team: a, gpus: 2, duration_s: 70, depends_on: "afterok:prep"}
    - {id: report, team: a, gpus: 1, duration_s: 10,
       depends_on: [{type: afterok, job_id: train}, {type: afterany, job_id: sweep}]}
    - {id: huge, team: a, gpus: 16, duration_s: 10}
    - {id: never, team: a, gpus: 1, duration_s: 10, depends_on: "afterok:huge"}
    - {id: never2, team: a, gpus: 1, duration_s: 10, depends_on: "afterany:never"}
    - {id: cleanup, team: a, gpus: 1, duration_s: 10, depends_on: "afternotok:huge"}
"""


def run(tmp_path: Path, text: str) -> Engine:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    sc = load_scenario(path)
    eng = Engine(sc.groups, sc.teams, sc.jobs, sc.policy, sc.engine)
    eng.run()
    return eng


def test_array_limit_and_dependency_chain(tmp_path: Path) -> None:
    eng = run(tmp_path, SCENARIO)
    jobs = eng.fleet.jobs
    tasks = [j for j in jobs if j.startswith("sweep[")]
    assert len(tasks) == 20 and all(jobs[t].status == "SUCCEEDED" for t in tasks)
    # never more than 3 tasks of the array hold GPUs at once (8 GPUs were free)
    edges = sorted(
        (t, d)
        for run_ in eng.fleet.runs.values()
        if run_.job_id.startswith("sweep[")
        for t, d in ((run_.reserved_s, 1), (run_.released_s, -1))
    )
    cur = peak = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    assert peak == 3
    start = {j: js.first_start_s for j, js in jobs.items()}
    end = {j: js.end_s for j, js in jobs.items()}
    assert start["train"] >= end["prep"]
    assert start["report"] >= max(end["train"], *(end[t] for t in tasks))
    assert jobs["report"].status == "SUCCEEDED"
    # afterok on a job that can never run: DEPENDENCY_FAILED, and its afterany dependent runs
    assert jobs["huge"].status == "EXPIRED"
    assert jobs["never"].status == "DEPENDENCY_FAILED" and jobs["never"].runs == []
    assert jobs["never2"].status == "SUCCEEDED"
    # afternotok means "ran and did not succeed": an EXPIRED job never ran (issue 24, item 10)
    assert jobs["cleanup"].status == "DEPENDENCY_FAILED" and jobs["cleanup"].runs == []
    assert sorted(eng.dependency_failed) == ["cleanup", "never"]
    assert eng.violations == 0


@pytest.mark.parametrize(
    ("job", "needle"),
    [
        ('{id: x, team: a, duration_s: 1, array: "5-1"}', "array"),
        ('{id: x, team: a, duration_s: 1, depends_on: "afterok:nope"}', "unknown job 'nope'"),
        ('{id: x, team: a, duration_s: 1, depends_on: "soon:y"}', "depends_on"),
        ("{id: x, team: a, duration_s: 1, colour: red}", "unknown keys"),
    ],
)
def test_bad_jobs_name_the_field(tmp_path: Path, job: str, needle: str) -> None:
    text = SCENARIO.split("  jobs:")[0] + f"  jobs:\n    - {job}\n"
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=r"workload\.jobs|depends_on") as err:
        load_scenario(path)
    assert needle in str(err.value)
