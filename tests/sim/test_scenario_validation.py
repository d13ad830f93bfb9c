"""Every scenario value is checked when the scenario is loaded: a bad one is a ScenarioError
whose message names the field (never a hang, a traceback or a bare conversion error)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from gpufleet.sim.cli import app
from gpufleet.sim.config import ScenarioError, load_scenario

BASE: dict[str, Any] = {
    "name": "t",
    "cluster": {
        "node_groups": [{"name": "a100", "count": 2, "gpus_per_node": 8, "gpu_type": "A100"}]
    },
    "teams": [{"id": "train", "guaranteed_gpus": {"A100": 8}}, {"id": "nb"}],
    "workload": {
        "synthetic": {
            "horizon_h": 2,
            "teams": [
                {"id": "train", "jobs_per_hour": 2, "sizes": {8: 0.7, 4: 0.3}},
                {"id": "nb", "jobs_per_hour": 4, "priorities": {"LOW": 0.5, "HIGH": 0.5}},
            ],
        }
    },
    "policy": {},
    "engine": {"grace_s": 30},
    "compare": ["fifo"],
}

SYN = "workload.synthetic"


def scenario(tmp_path: Path, edit: dict[str, Any]) -> Path:
    """BASE with ``edit`` applied: keys are dotted paths (list indexes as numbers)."""
    raw = copy.deepcopy(BASE)
    for dotted, value in edit.items():
        *parents, last = dotted.split(".")
        node: Any = raw
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


BAD = [
    ({f"{SYN}.teams.0.jobs_per_hour": -1}, "workload.synthetic.teams[0].jobs_per_hour"),
    ({f"{SYN}.teams.0.jobs_per_hour": 0}, "workload.synthetic.teams[0].jobs_per_hour"),
    ({f"{SYN}.teams.0.jobs_per_hour": "lots"}, "workload.synthetic.teams[0].jobs_per_hour"),
    ({f"{SYN}.teams.0.jobs_per_hour": 1e12}, "workload.synthetic"),
    ({"cluster.node_groups.0.count": 0}, "cluster.node_groups[0].count"),
    ({"cluster.node_groups.0.count": -1}, "cluster.node_groups[0].count"),
    ({"cluster.node_groups.0.count": "x"}, "cluster.node_groups[0].count"),
    ({"cluster.node_groups.0.count": 1.5}, "cluster.node_groups[0].count"),
    ({"cluster.node_groups.0.gpus_per_node": 0}, "cluster.node_groups[0].gpus_per_node"),
    ({"cluster.node_groups.0": {"name": "g", "count": 1}}, "cluster.node_groups[0].gpus_per_node"),
    ({f"{SYN}.teams.1.fail_prob": 2}, "workload.synthetic.teams[1].fail_prob"),
    ({f"{SYN}.teams.1.fail_prob": -0.1}, "workload.synthetic.teams[1].fail_prob"),
    ({"engine.grace_s": -5}, "engine.grace_s"),
    ({"engine.sample_interval_s": 0}, "engine.sample_interval_s"),
    ({"engine.horizon_h": 0}, "engine.horizon_h"),
    ({"engine.horizon_h": "abc"}, "engine.horizon_h"),
    ({"engine.check_invariants": "sometimes"}, "engine.check_invariants"),
    ({"engine.predict_durations": "yes"}, "engine.predict_durations"),
    ({"engine.bogus": 1}, "engine"),
    ({f"{SYN}.teams.1.id": "ghost"}, "workload.synthetic.teams[1].id"),
    ({f"{SYN}.teams.0.sizes": {8: -0.7, 4: 0.3}}, "workload.synthetic.teams[0].sizes[8]"),
    ({f"{SYN}.teams.0.sizes": {8: 0, 4: 0}}, "workload.synthetic.teams[0].sizes"),
    ({f"{SYN}.teams.0.sizes": {0: 1.0}}, "workload.synthetic.teams[0].sizes"),
    ({f"{SYN}.teams.1.priorities": {"URGENT": 1}}, "workload.synthetic.teams[1].priorities"),
    ({f"{SYN}.teams.0.median_duration_s": 0}, "workload.synthetic.teams[0].median_duration_s"),
    ({f"{SYN}.teams.0.sigma": -1}, "workload.synthetic.teams[0].sigma"),
    ({f"{SYN}.teams.0.checkpoint_s": 0}, "workload.synthetic.teams[0].checkpoint_s"),
    ({f"{SYN}.teams.0.bounded": "no"}, "workload.synthetic.teams[0].bounded"),
    ({f"{SYN}.teams.0.jobs_pr_hour": 1}, "workload.synthetic.teams[0]"),
    ({f"{SYN}.horizon_h": 0}, "workload.synthetic.horizon_h"),
    ({f"{SYN}.horizon_h": "abc"}, "workload.synthetic.horizon_h"),
    ({f"{SYN}.horizon_h": float("inf")}, "workload.synthetic.horizon_h"),
    ({f"{SYN}.teams": []}, "workload.synthetic.teams"),
    ({"compare": ["fifo", "bogus"]}, "compare[1]"),
    ({"compare": "bogus"}, "compare[0]"),
    ({"compare": {"fifo": 1}}, "compare"),
    ({"policy": {"bogus_knob": 1}}, "backfill_depth"),  # the valid knobs are listed
    ({"policy": {"baseline": "bogus"}}, "policy.baseline"),
    ({"policy": {"ordering": "random"}}, "policy.ordering"),
    ({"policy": {"borrowing": "no"}}, "policy.borrowing"),
    ({"policy": {"max_reservations": -1}}, "policy.max_reservations"),
    ({"policy": {"head_start_s": {"URGENT": 5}}}, "policy.head_start_s"),
    ({"policy": {"large_job_node_share": 2}}, "policy.large_job_node_share"),
    ({"teams.0.weight": "heavy"}, "teams[0].weight"),
    ({"teams.0.guaranteed_gpus": {"A100": "x"}}, "teams[0].guaranteed_gpus[A100]"),
    ({"teams.0.borrow_limit_gpus": -1}, "teams[0].borrow_limit_gpus"),
    ({"teams.1.id": "train"}, "teams[1].id"),
    ({"teams.0": {"weight": 1}}, "teams[0].id"),
    ({"workload.nonsense": {}}, "workload"),
    ({"cluster.node_groups.0.labels": ["a"]}, "cluster.node_groups[0].labels"),
]


@pytest.mark.parametrize(("edit", "field"), BAD, ids=[str(e) for e, _ in BAD])
def test_bad_values_name_the_field(tmp_path: Path, edit: dict[str, Any], field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        load_scenario(scenario(tmp_path, edit))
    message = str(err.value)
    assert field in message, message
    assert str(tmp_path / "s.yaml") in message
    assert "could not convert" not in message


def test_the_base_scenario_loads(tmp_path: Path) -> None:
    sc = load_scenario(scenario(tmp_path, {}))
    assert sc.jobs and sc.compare == ("fifo",)


def test_one_baseline_as_a_string_is_a_one_item_list(tmp_path: Path) -> None:
    assert load_scenario(scenario(tmp_path, {"compare": "spread"})).compare == ("spread",)


def test_a_negative_rate_fails_fast_instead_of_hanging(tmp_path: Path) -> None:
    path = scenario(tmp_path, {f"{SYN}.teams.0.jobs_per_hour": -1})
    start = time.monotonic()
    with pytest.raises(ScenarioError, match=r"teams\[0\]\.jobs_per_hour must be a number > 0"):
        load_scenario(path)
    assert time.monotonic() - start < 5


def test_the_message_names_the_value_and_bound(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as err:
        load_scenario(scenario(tmp_path, {f"{SYN}.teams.0.jobs_per_hour": -1}))
    assert str(err.value).endswith(
        "workload.synthetic.teams[0].jobs_per_hour must be a number > 0, not -1"
    )


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"engine.horizon_h": "abc"}, "engine.horizon_h"),
        ({"policy": {"bogus_knob": 1}}, "policy: unknown keys ['bogus_knob']"),
        ({f"{SYN}.teams.1.priorities": {"URGENT": 1}}, "CRITICAL, HIGH, NORMAL, LOW"),
    ],
)
def test_cli_prints_one_line_naming_the_field(
    tmp_path: Path, edit: dict[str, Any], field: str
) -> None:
    result = CliRunner().invoke(app, ["run", str(scenario(tmp_path, edit)), "--no-plots"])
    assert result.exit_code == 2, result.output
    assert field in result.output
    assert "Traceback" not in result.output


def test_cli_prints_n_a_without_a_unit(tmp_path: Path) -> None:
    """No job finishes (the only one can never fit): the wait percentiles are undefined, and
    the line never reads ``n/as``."""
    big = {"id": "big", "team": "nb", "gpus": 1000, "duration_s": 10}
    path = scenario(tmp_path, {"workload": {"jobs": [big]}})
    result = CliRunner().invoke(
        app, ["run", str(path), "--no-plots", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 0, result.output
    assert "wait mean=n/a p95=n/a" in result.stdout
    assert "n/as" not in result.stdout


@pytest.mark.parametrize("capacity", ["x", None, 0, 101])
def test_philly_capacity_is_checked_before_the_trace_is_read(
    tmp_path: Path, capacity: object
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump({"cluster": {"philly_vcs": {"path": "nothere.csv", "capacity": capacity}}})
    )
    with pytest.raises(ScenarioError, match=r"cluster\.philly_vcs\.capacity must be a number"):
        load_scenario(path, traces_dir=tmp_path)


@pytest.mark.parametrize(
    ("job", "field"),
    [
        ({"id": "j", "team": "ghost", "duration_s": 10}, "workload.jobs (j).team"),
        ({"id": "j", "team": "nb", "gpus": -1, "duration_s": 10}, "workload.jobs[0].gpus"),
        ({"id": "j", "team": "nb", "duration_s": "long"}, "workload.jobs[0].duration_s"),
        ({"id": "j", "team": "nb"}, "workload.jobs[0].duration_s is required"),
        ({"id": "j", "team": "nb", "duration_s": 1, "priority": "URGENT"}, "[0].priority"),
        ({"id": "j", "team": "nb", "duration_s": 1, "submit_s": -1}, "workload.jobs[0].submit_s"),
    ],
)
def test_explicit_job_values_name_the_field(
    tmp_path: Path, job: dict[str, Any], field: str
) -> None:
    path = scenario(tmp_path, {"workload": {"jobs": [job]}})
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert field in str(err.value), str(err.value)
