"""Scenarios at and beyond the limits (found by a new-user test): huge sizes and times are
refused with one line naming the field (exit 2), long idle stretches cost nothing, runs that
leave jobs behind say so, and undefined metrics are ``null``/``n/a``."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from typer.testing import CliRunner

from gpufleet.policy.config import PolicyConfig
from gpufleet.sim import cli as sim_cli
from gpufleet.sim.cli import app, run_sim
from gpufleet.sim.config import BASELINES, ScenarioError, load_scenario
from gpufleet.sim.engine import Engine, EngineOptions
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec


def write(tmp_path: Path, raw: dict[str, Any], name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def one_node(jobs: list[dict[str, Any]], *, teams: Any = None, **extra: Any) -> dict[str, Any]:
    """One 8-GPU node, team ``a`` (guarantee 8), and these jobs."""
    return {
        "cluster": {"node_groups": [{"name": "n", "count": 1, "gpus_per_node": 8}]},
        "teams": teams if teams is not None else [{"id": "a", "guaranteed_gpus": {"GPU": 8}}],
        "workload": {"jobs": jobs},
        **extra,
    }


JOB = {"id": "j", "team": "a", "duration_s": 10}


def run_cli(tmp_path: Path, path: Path, *args: str) -> Any:
    return CliRunner().invoke(
        app, ["run", str(path), "--no-plots", "--out", str(tmp_path / "out"), *args]
    )


def report(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))


class TestHugeValuesAreRefused:
    """Item 1 and 2 of the new-user test: sizes that ran out of memory or overflowed in the
    policy, and times that made the run look hung, are refused when the scenario loads."""

    CASES: ClassVar = [
        pytest.param({"gpus": 10**12}, "workload.jobs[0].gpus", id="job gpus 1e12"),
        pytest.param({"gpus": "1e30"}, "workload.jobs[0].gpus", id="job gpus 1e30"),
        pytest.param({"duration_s": 1e11}, "workload.jobs[0].duration_s", id="duration 1e11"),
        pytest.param({"submit_s": 1e11}, "workload.jobs[0].submit_s", id="submit 1e11"),
        pytest.param({"submit_s": 1e300}, "workload.jobs[0].submit_s", id="submit 1e300"),
        pytest.param({"max_runtime_s": 1e12}, "workload.jobs[0].max_runtime_s", id="bound"),
    ]

    @pytest.mark.parametrize(("job_edit", "field"), CASES)
    def test_job_values(self, tmp_path: Path, job_edit: dict[str, Any], field: str) -> None:
        path = write(tmp_path, one_node([{**JOB, **job_edit}]))
        with pytest.raises(ScenarioError, match=r"<= [\d,]+, not") as err:
            load_scenario(path)
        message = str(err.value)
        assert field in message
        assert message.count(str(path)) == 1, message  # the file is named once

    SCENARIO_CASES: ClassVar = [
        pytest.param(
            {"cluster": {"node_groups": [{"name": "n", "count": 1, "gpus_per_node": 10**9}]}},
            "cluster.node_groups[0].gpus_per_node must be an integer >= 1 and <= 1,024",
            id="gpus_per_node 1e9",
        ),
        pytest.param(
            {"cluster": {"node_groups": [{"name": "n", "count": 10**8, "gpus_per_node": 8}]}},
            "cluster.node_groups[0].count must be an integer >= 1 and <= 100,000",
            id="count 1e8",
        ),
        pytest.param(
            {
                "cluster": {
                    "node_groups": [
                        {"name": "a", "count": 60_000, "gpus_per_node": 8},
                        {"name": "b", "count": 60_000, "gpus_per_node": 8},
                    ]
                }
            },
            "cluster has 120,000 nodes in all, more than 100,000",
            id="nodes in all",
        ),
        pytest.param(
            {
                "workload": {
                    "synthetic": {
                        "horizon_h": 1,
                        "teams": [{"id": "a", "jobs_per_hour": 2, "sizes": {10**20: 1}}],
                    }
                }
            },
            "workload.synthetic.teams[0].sizes key",
            id="synthetic size 1e20",
        ),
        pytest.param(
            {
                "workload": {
                    "synthetic": {
                        "horizon_h": 2,
                        "teams": [{"id": "a", "jobs_per_hour": 20, "sigma": 12}],
                    }
                }
            },
            "workload.synthetic.teams[0].sigma must be a number >= 0 and <= 5",
            id="sigma 12",
        ),
        pytest.param(
            {"engine": {"sample_interval_s": 1e-6}},
            "engine.sample_interval_s must be a number >= 1",
            id="sample interval 1e-6",
        ),
        pytest.param(
            {"engine": {"horizon_h": 1e9}}, "engine.horizon_h", id="horizon beyond 10 years"
        ),
    ]

    @pytest.mark.parametrize(("edit", "want"), SCENARIO_CASES)
    def test_scenario_values(self, tmp_path: Path, edit: dict[str, Any], want: str) -> None:
        path = write(tmp_path, {**one_node([JOB]), **edit})
        start = time.process_time()
        result = run_cli(tmp_path, path)
        assert time.process_time() - start < 10  # refused at load, not after a long run
        assert result.exit_code == 2, result.output
        assert want in result.output
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output

    def test_a_job_larger_than_the_fleet_never_fits_without_being_split(
        self, tmp_path: Path
    ) -> None:
        """A million GPUs on one 8-GPU node: rejected at arrival by the fleet's size, never
        split into 125,000 gang members by the policy."""
        path = write(tmp_path, one_node([{**JOB, "gpus": 1_000_000}, {**JOB, "id": "k"}]))
        result = run_cli(tmp_path, path)
        assert result.exit_code == 0, result.output
        assert "warning: run main: 1 job can never fit (more GPUs than the fleet's 8)" in (
            result.stderr
        )
        assert report(tmp_path)["runs"]["main"]["jobs"]["rejected_never_fit"] == 1

    @pytest.mark.parametrize("exc", [MemoryError(), OverflowError("int too large")])
    def test_the_last_resort_is_one_line(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: Exception
    ) -> None:
        def boom(*_args: Any, **_kwargs: Any) -> None:
            raise exc

        monkeypatch.setattr(sim_cli, "run_sim", boom)
        path = write(tmp_path, one_node([JOB]))
        result = run_cli(tmp_path, path)
        assert result.exit_code == 2
        assert result.output.startswith(f"error: {path}: {type(exc).__name__}")
        assert "Traceback" not in result.output


class TestIdleStretches:
    """Item 2: a stretch with nothing happening costs one sample, however long it is."""

    def test_a_long_job_with_short_samples_is_fast_and_counts_every_sample(self) -> None:
        week = 7 * 86400.0
        eng = Engine(
            [NodeGroup("n", 2, 8, "GPU")],
            [TeamSpec("a")],
            [SimJob("j", "a", 0.0, 8, week)],
            PolicyConfig(),
            EngineOptions(sample_interval_s=1.0),
        )
        start = time.process_time()
        eng.run()
        assert time.process_time() - start < 5
        rec = eng.rec
        # samples due at 0, 1, ..., week (each taken before that instant's events): both
        # nodes free at 0, before the job arrives; then one busy and one free
        n = int(week)
        assert rec.free_hist == {8: 2 + n, 0: n}
        # a point at the first and the last sample of each stretch: [0], then [1, week]
        assert [s[0] for s in rec.samples] == [0.0, 1.0, week]

    def test_same_counts_as_sampling_one_by_one(self) -> None:
        """The weighted sample equals the sum of the samples it stands for (a loop of
        one-interval steps, the engine before)."""

        def run(interval: float) -> dict[int, int]:
            eng = Engine(
                [NodeGroup("n", 1, 8, "GPU")],
                [TeamSpec("a")],
                [SimJob("j", "a", 5.0, 4, 1000.0), SimJob("k", "a", 30.0, 4, 77.0)],
                PolicyConfig(),
                EngineOptions(sample_interval_s=interval),
            )
            eng.run()
            return eng.rec.free_hist

        # at 0 all free; 10..30 j alone (a sample is taken before its instant's events);
        # 40..100 j and k; 110..1000 j alone
        assert run(10.0) == {8: 1, 4: 3 + 90, 0: 7}
        assert sum(run(1.0).values()) == 1006  # samples at 0..1005


class TestUnfinishedJobsAreShown:
    """Item 3: the summary names the jobs a run did not finish."""

    def test_never_fit_warning_names_the_cause(self, tmp_path: Path) -> None:
        teams = [{"id": "a"}, {"id": "b"}]
        jobs = [{**JOB, "gpus": 8}, {**JOB, "id": "k", "team": "b", "gpus": 8}]
        path = write(tmp_path, one_node(jobs, teams=teams, compare=["no_borrowing"]))
        result = run_cli(tmp_path, path)
        assert result.exit_code == 0, result.output
        want = [
            f"warning: run no_borrowing: 1 job can never fit (team {t!r} has no nodes of its "
            "own: it has no guarantee, and this policy runs each team only on nodes covering "
            "its guarantee)"
            for t in ("a", "b")
        ]
        assert all(w in result.stderr for w in want)
        main, nob = (line for line in result.stdout.splitlines() if "finished=" in line)
        assert "finished=2 never_fit=0 unfinished=0" in main
        assert "finished=0 never_fit=2 unfinished=0" in nob
        assert report(tmp_path)["warnings"] == [w.removeprefix("warning: ") for w in want]

    @pytest.mark.parametrize(
        ("job", "want"),
        [
            pytest.param(SimJob("j", "a", 0.0, 25, 1.0), "more GPUs than the fleet's 24"),
            pytest.param(
                SimJob("j", "a", 0.0, 12, 1.0),
                "a gang of whole nodes only: 12 GPUs on 8-GPU nodes",
                id="12 GPUs on 8-GPU nodes",
            ),
            pytest.param(
                SimJob("j", "a", 0.0, 1, 1.0, gpu_types=("H100",)),
                "a GPU type the fleet lacks",
                id="missing GPU type",
            ),
        ],
    )
    def test_never_fit_causes(self, job: SimJob, want: str) -> None:
        eng = Engine([NodeGroup("n", 3, 8, "GPU")], [TeamSpec("a")], [job], PolicyConfig())
        eng.run()
        assert eng.rejected_causes == {want: 1}

    def test_no_warnings_key_when_every_job_finished(self, tmp_path: Path) -> None:
        result = run_cli(tmp_path, write(tmp_path, one_node([JOB])))
        assert result.exit_code == 0, result.output
        assert "warning:" not in result.stderr
        assert "warnings" not in report(tmp_path)

    @pytest.mark.parametrize(
        ("raw", "want"),
        [
            pytest.param({"workload": {"jobs": [JOB]}}, "cluster has no nodes", id="no cluster"),
            pytest.param(one_node([]), "workload.jobs gives no jobs", id="no jobs"),
            pytest.param(
                {**one_node([JOB]), "workload": None}, "workload has no jobs", id="no workload"
            ),
            pytest.param(
                {
                    **one_node([JOB]),
                    "workload": {
                        "synthetic": {
                            "horizon_h": 0.001,
                            "teams": [{"id": "a", "jobs_per_hour": 0.001}],
                        }
                    },
                },
                "workload.synthetic gives no jobs (raise jobs_per_hour or horizon_h)",
                id="synthetic rate too low",
            ),
        ],
    )
    def test_nothing_to_simulate_is_an_error(
        self, tmp_path: Path, raw: dict[str, Any], want: str
    ) -> None:
        result = run_cli(tmp_path, write(tmp_path, raw))
        assert result.exit_code == 2, result.output
        assert want in result.output

    def test_a_philly_window_that_ends_before_it_starts(self, tmp_path: Path) -> None:
        raw = {
            **one_node([JOB]),
            "workload": {
                "philly": {
                    "path": "jobs.csv",
                    "start": "2017-10-02 00:00:00",
                    "end": "2017-10-01 00:00:00",
                }
            },
        }
        (tmp_path / "jobs.csv").write_text("jobid\n", encoding="utf-8")
        with pytest.raises(ScenarioError, match=r"workload\.philly\.end .* must be after"):
            load_scenario(write(tmp_path, raw), traces_dir=tmp_path)


def test_the_horizon_stops_the_clock_at_the_horizon(tmp_path: Path) -> None:
    """Item 4: with horizon_h: 1, a job waiting since t=10 has waited 3590 s at the end (it
    showed 0: the clock stopped at the last event before the horizon)."""
    jobs = [
        {"id": "j", "team": "a", "gpus": 8, "duration_s": 100000},
        {"id": "k", "team": "a", "gpus": 8, "submit_s": 10, "duration_s": 10},
    ]
    result = run_cli(tmp_path, write(tmp_path, one_node(jobs, engine={"horizon_h": 1})))
    assert result.exit_code == 0, result.output
    main = report(tmp_path)["runs"]["main"]
    assert main["run"]["sim_end_s"] == 3600
    assert main["starvation"]["longest_wait_s"] == 3590
    assert main["starvation"]["longest_wait_job"] == "k"
    assert main["jobs"]["unfinished"] == 2
    assert "2 jobs unfinished (the clock stopped at engine.horizon_h)" in result.stderr


def test_metrics_without_a_backlog_are_undefined(tmp_path: Path) -> None:
    """Item 5: no job ever waited, so allocation under backlog is undefined (it read 0.000);
    no job started, so the longest wait is undefined (it read 0s beside a null job)."""
    result = run_cli(tmp_path, write(tmp_path, one_node([JOB])))
    assert result.exit_code == 0, result.output
    assert "alloc(backlog)=n/a" in result.stdout
    allocation = report(tmp_path)["runs"]["main"]["allocation"]
    assert allocation["under_backlog"] is None
    fragmentation = report(tmp_path)["runs"]["main"]["fragmentation"]
    assert fragmentation["mean_free_gpus_while_backlogged"] is None

    result = run_cli(tmp_path, write(tmp_path, one_node([{**JOB, "gpus": 9}])))
    assert result.exit_code == 0, result.output
    assert "longest=n/a" in result.stdout
    starvation = report(tmp_path)["runs"]["main"]["starvation"]
    assert starvation["longest_wait_s"] is None
    assert starvation["longest_wait_job"] is None


class TestErrorTexts:
    """Item 6: each error names the file and the field once."""

    def test_a_job_error_names_the_file_once(self, tmp_path: Path) -> None:
        path = write(tmp_path, one_node([{**JOB, "gpus": True}]))
        result = run_cli(tmp_path, path)
        assert result.exit_code == 2
        assert result.output.count(str(path)) == 1, result.output
        assert "workload.jobs[0].gpus must be an integer" in result.output

    def test_duplicate_job_ids_name_the_field_and_id(self, tmp_path: Path) -> None:
        path = write(tmp_path, one_node([JOB, JOB]))
        with pytest.raises(ScenarioError) as err:
            load_scenario(path)
        assert str(err.value) == (
            f"{path}: workload.jobs[1].id: job id 'j' is used twice (first at workload.jobs[0])"
        )

    def test_a_wrong_trace_file_names_the_missing_column(self, tmp_path: Path) -> None:
        (tmp_path / "jobs.csv").write_text("jobid,user\n1,u\n", encoding="utf-8")
        raw = {"cluster": {"philly_vcs": {"path": "jobs.csv"}}, "workload": {"jobs": [JOB]}}
        with pytest.raises(ScenarioError) as err:
            load_scenario(write(tmp_path, raw), traces_dir=tmp_path)
        assert "cluster.philly_vcs.path" in str(err.value)
        assert "has no column 'vc'" in str(err.value)

    def test_a_folder_as_trace_file_names_the_field(self, tmp_path: Path) -> None:
        (tmp_path / "philly_2017").mkdir()
        raw = {"cluster": {"philly_vcs": {"path": "philly_2017"}}, "workload": {"jobs": [JOB]}}
        with pytest.raises(ScenarioError, match=r"cluster\.philly_vcs\.path: .* is a folder"):
            load_scenario(write(tmp_path, raw), traces_dir=tmp_path)

    def test_a_file_not_in_utf8_is_named(self, tmp_path: Path) -> None:
        path = tmp_path / "latin1.yaml"
        path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
        result = run_cli(tmp_path, path)
        assert result.exit_code == 2
        assert result.output.startswith(f"error: {path}: not UTF-8 text")

    def test_invalid_yaml_is_one_line(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.yaml"
        path.write_text("cluster:\n  - [\n", encoding="utf-8")
        result = run_cli(tmp_path, path)
        assert result.exit_code == 2
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert "not valid YAML at line" in result.output

    def test_a_key_given_twice_is_refused(self, tmp_path: Path) -> None:
        """PyYAML keeps the last of two equal keys; a scenario with two ``workload:``
        sections would run one of them silently."""
        path = tmp_path / "twice.yaml"
        path.write_text("name: x\nworkload: {jobs: []}\nworkload: {jobs: []}\n", "utf-8")
        result = run_cli(tmp_path, path)
        assert result.exit_code == 2
        assert "at line 3, column 1: found the key 'workload' twice (first at line 2)" in (
            result.output
        )

    def test_out_an_existing_file_names_out(self, tmp_path: Path) -> None:
        (tmp_path / "out").write_text("", encoding="utf-8")
        result = run_cli(tmp_path, write(tmp_path, one_node([JOB])))
        assert result.exit_code == 2
        assert result.output.startswith(f"error: --out {tmp_path / 'out'}: exists")


def test_plots_of_a_small_scenario_warn_nothing(tmp_path: Path) -> None:
    """Item 7: a size no job had and a team with nothing allocated draw no legend, and no
    matplotlib warning is raised."""
    teams = [{"id": "a", "guaranteed_gpus": {"GPU": 8}}, {"id": "b"}]
    path = write(tmp_path, one_node([JOB, {**JOB, "id": "big", "gpus": 9}], teams=teams))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = run_sim(path, tmp_path / "out", plots=True, compare=("no_borrowing",))
    assert rep["html"] == "report.html"


def test_the_design_doc_lists_every_baseline() -> None:
    """Item 7: ``sim baselines`` and the compare list of docs/design/simulator.md agree."""
    doc = Path(__file__).parents[2] / "docs" / "design" / "simulator.md"
    lines = doc.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("* **compare**"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
    compare = "\n".join(lines[start:end])  # the bullet and its indented continuation
    missing = [name for name in BASELINES if f"`{name}`" not in compare]
    assert not missing, missing
