"""Undefined metrics are reported as undefined: null in report.json, ``n/a`` when printed."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gpufleet.sim.cli import app
from gpufleet.sim.fleet import InMemoryFleet
from gpufleet.sim.metrics import Recorder, shown, summary

ONE_TEAM = """
name: one-team
cluster:
  node_groups: [{name: n, count: 1, gpus_per_node: 1}]
teams: [{id: a, guaranteed_gpus: {GPU: 1}}]
workload:
  jobs:
    - {id: first, team: a, submit_s: 0, duration_s: 100}
    - {id: second, team: a, submit_s: 10, duration_s: 100}
"""


def test_jain_is_undefined_without_two_backlogged_teams(tmp_path: Path) -> None:
    """Only one team ever waits: there is no contention to be fair about, so Jain's index is
    null/n/a (it printed 1.000 before), while the waits it did measure are numbers."""
    cfg = tmp_path / "one.yaml"
    cfg.write_text(ONE_TEAM, encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "jain=n/a" in result.output
    assert "wait mean=45s" in result.output  # (0 + 90) / 2
    rep = json.loads((out / "report.json").read_text(encoding="utf-8"))
    fairness = rep["runs"]["main"]["fairness"]
    assert fairness["jain_backlogged_time_weighted"] is None
    assert fairness["share_of_time_two_or_more_teams_backlogged"] == 0.0


def test_no_jobs_no_numbers() -> None:
    assert summary([]) == {"n": 0}
    assert shown(summary([]).get("mean")) == "n/a"
    assert shown(12.345, ".1f") == "12.3"
    rec = Recorder(8, {"a": 8.0, "b": 8.0})
    rec.integrate(0.0, 10.0, {"a": 8, "b": 0}, {"b"})  # one team backlogged: no Jain sample
    rec.close(20.0, InMemoryFleet([]))
    rep = rec.report()
    assert rep["fairness"]["jain_backlogged_time_weighted"] is None
    assert rep["queue_delay_s"]["all"] == {"n": 0}
    rec.integrate(20.0, 30.0, {"a": 8, "b": 0}, {"a", "b"})  # a at 1.0, b at 0.0: Jain 0.5
    assert rec.report()["fairness"]["jain_backlogged_time_weighted"] == 0.5
