"""A new user's trial of ``gpufleet sim run``: runtime estimates said and reported, negative
seeds, the output folder (stale files, bad paths), and doubtful input refused or warned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufleet.sim import cli as sim_cli
from gpufleet.sim.cli import app, run_sim
from gpufleet.sim.config import ScenarioError, load_scenario
from gpufleet.sim.loaders import SyntheticTeam, synthetic

HERE = Path(__file__).parent
CLUSTER = "cluster:\n  node_groups:\n    - {name: g, count: 2, gpus_per_node: 8, gpu_type: A100}\n"
TEAMS = (
    "teams:\n  - {id: a, guaranteed_gpus: {A100: 8}}\n  - {id: b, guaranteed_gpus: {A100: 8}}\n"
)
JOBS = (
    "workload:\n  jobs:\n"
    "    - {id: j1, team: a, submit_s: 0, gpus: 4, duration_s: 100}\n"
    "    - {id: j2, team: b, submit_s: 10, gpus: 8, duration_s: 200}\n"
)


def synthetic_yaml(*teams: str) -> str:
    lines = "".join(f"      - {t}\n" for t in teams)
    return CLUSTER + TEAMS + f"workload:\n  synthetic:\n    horizon_h: 2\n    teams:\n{lines}"


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["run", *args])


def report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


class TestEstimates:
    """Synthetic jobs always carried their true duration as the estimate (an oracle), and
    ``estimate: none`` on a synthetic team was refused as an unknown key."""

    def test_a_synthetic_team_without_estimates_gives_none(self) -> None:
        jobs = list(synthetic([SyntheticTeam("a", 20.0, estimate="none")], 7200.0, seed=3))
        assert jobs
        assert all(j.expected_duration_s is None for j in jobs)

    def test_the_default_stays_exact_and_the_workload_is_the_same(self) -> None:
        exact = list(synthetic([SyntheticTeam("a", 20.0)], 7200.0, seed=3))
        none = list(synthetic([SyntheticTeam("a", 20.0, estimate="none")], 7200.0, seed=3))
        assert all(j.expected_duration_s == j.duration_s for j in exact)
        assert [(j.submit_s, j.gpus, j.duration_s) for j in exact] == [
            (j.submit_s, j.gpus, j.duration_s) for j in none
        ]

    def test_the_scenario_accepts_it_and_predicts_as_philly_does(self, tmp_path: Path) -> None:
        path = write(
            tmp_path,
            synthetic_yaml(
                "{id: a, jobs_per_hour: 10, estimate: none}", "{id: b, jobs_per_hour: 10}"
            ),
        )
        sc = load_scenario(path)
        assert sc.estimates == {"synthetic": {"a": "none", "b": "exact"}}
        assert {j.team_id for j in sc.jobs if j.expected_duration_s is None} == {"a"}
        assert sc.engine.predict_durations  # as under philly.estimate: none

    def test_an_unknown_estimate_names_the_field(self, tmp_path: Path) -> None:
        path = write(tmp_path, synthetic_yaml("{id: a, jobs_per_hour: 10, estimate: guess}"))
        with pytest.raises(ScenarioError, match=r"teams\[0\]\.estimate must be one of exact"):
            load_scenario(path)

    def test_the_header_and_report_say_which(self, tmp_path: Path) -> None:
        path = write(tmp_path, synthetic_yaml("{id: a, jobs_per_hour: 10}"))
        out = tmp_path / "out"
        result = run_cli(str(path), "--out", str(out), "--no-plots")
        assert result.exit_code == 0, result.output
        assert "runtime estimates: synthetic=exact (oracle)" in result.stdout
        assert report(out)["estimates"] == {"synthetic": {"a": "exact"}}

    def test_philly_without_the_key_is_exact(self, tmp_path: Path) -> None:
        vcs = write(tmp_path, "vc,node num\ne13805,2\n7f04ca,2\n", "vcs.csv")
        sample = HERE / "data" / "philly_sample.csv"
        text = (
            f"cluster:\n  philly_vcs: {{path: {vcs}}}\n"
            f"workload:\n  philly: {{path: {sample}, end: '2017-10-02 00:00:00'}}\n"
        )
        assert load_scenario(write(tmp_path, text)).estimates == {"philly": "exact"}
        text = text.replace("00:00:00'}", "00:00:00', estimate: none}")
        assert load_scenario(write(tmp_path, text)).estimates == {"philly": "none"}


class TestSeed:
    """``--seed -1`` gave the workload of ``--seed 1`` (``random.Random`` takes |seed|)
    while report.json said -1."""

    def test_a_negative_seed_is_refused_naming_the_option(self, tmp_path: Path) -> None:
        path = write(tmp_path, synthetic_yaml("{id: a, jobs_per_hour: 10}"))
        result = run_cli(str(path), "--out", str(tmp_path / "out"), "--seed", "-1")
        assert result.exit_code == 2
        assert "--seed" in result.output
        assert not (tmp_path / "out" / "report.json").exists()

    def test_run_sim_refuses_it_too(self, tmp_path: Path) -> None:
        path = write(tmp_path, synthetic_yaml("{id: a, jobs_per_hour: 10}"))
        with pytest.raises(ScenarioError, match="seed must be >= 0"):
            run_sim(path, tmp_path / "out", seed=-1, plots=False)


class TestOutputFolder:
    def test_a_run_replaces_what_an_earlier_run_wrote_and_nothing_else(
        self, tmp_path: Path
    ) -> None:
        """Scenario A with plots and a baseline, then scenario B with --no-plots into the
        same folder: A's report.html and plot folders used to stay beside B's report."""
        out = tmp_path / "out"
        (out / "main").mkdir(parents=True)
        (out / "main" / "notes.txt").write_text("mine")
        (out / "mine.txt").write_text("mine")
        a = write(tmp_path, CLUSTER + TEAMS + JOBS, "a.yaml")
        result = run_cli(str(a), "--out", str(out), "--compare", "fifo")
        assert result.exit_code == 0, result.output
        assert (out / "report.html").is_file()
        plots = sorted(report(out)["runs"]["fifo"]["plots"])
        assert sorted(p.name for p in (out / "fifo").iterdir()) == plots
        assert plots == sorted(getattr(sim_cli, "PLOT_FILES", ()))  # what a run clears
        b = write(tmp_path, synthetic_yaml("{id: a, jobs_per_hour: 10}"), "b.yaml")
        result = run_cli(str(b), "--out", str(out), "--no-plots")
        assert result.exit_code == 0, result.output
        left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
        assert left == ["main", "main/notes.txt", "mine.txt", "report.json"]
        assert report(out)["scenario"] == "b"

    def test_a_bad_scenario_keeps_the_earlier_report(self, tmp_path: Path) -> None:
        out = tmp_path / "out"
        out.mkdir()
        (out / "report.json").write_text("{}")
        bad = write(tmp_path, CLUSTER + "teams: 3\n")
        assert run_cli(str(bad), "--out", str(out)).exit_code == 2
        assert (out / "report.json").read_text() == "{}"
        assert run_cli(str(bad), "--out", str(tmp_path / "new")).exit_code == 2
        assert not (tmp_path / "new").exists()  # the check made it; the failure removes it

    @pytest.mark.parametrize(
        ("out", "want"),
        [
            pytest.param("", "--out is empty", id="empty"),
            pytest.param("{file}/sub", "{file} is a file, not a folder", id="through a file"),
            pytest.param("{file}", "exists and is not a folder", id="a file"),
        ],
    )
    def test_bad_out_is_refused_before_the_run(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, want: str
    ) -> None:
        afile = tmp_path / "afile"
        afile.write_text("x")
        calls: list[Any] = []
        monkeypatch.setattr(sim_cli, "run_sim", lambda *a, **_k: calls.append(a))
        path = write(tmp_path, CLUSTER + TEAMS + JOBS)
        result = run_cli(str(path), "--out", out.format(file=afile), "--no-plots")
        assert result.exit_code == 2
        assert result.output.startswith("error: --out")
        assert want.format(file=afile) in result.output
        assert "Error" not in result.output  # NotADirectoryError, FileNotFoundError
        assert calls == []

    @pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
    def test_a_folder_that_cannot_be_made(self, tmp_path: Path) -> None:
        path = write(tmp_path, CLUSTER + TEAMS + JOBS)
        result = run_cli(str(path), "--out", "/proc/gpufleet-x", "--no-plots")
        assert result.exit_code == 2
        assert result.output.startswith("error: --out /proc/gpufleet-x: cannot create the folder")


class TestDoubtfulInput:
    def test_a_team_listed_twice_names_the_field(self, tmp_path: Path) -> None:
        """It was ``job id 'a-000000' is used twice (by two workload sources)``."""
        path = write(
            tmp_path,
            synthetic_yaml("{id: a, jobs_per_hour: 10}", "{id: a, jobs_per_hour: 5}"),
        )
        result = run_cli(str(path), "--out", str(tmp_path / "out"))
        assert result.exit_code == 2
        assert "workload.synthetic.teams[1].id: team 'a' is listed twice" in result.output

    @pytest.mark.parametrize(
        ("text", "want"),
        [
            pytest.param(
                CLUSTER + TEAMS + JOBS + "policy: {displacement_budget_share: 7}\n",
                "policy.displacement_budget_share must be a number >= 0 and <= 1, not 7",
                id="budget share above 1",
            ),
            pytest.param(
                synthetic_yaml("{id: a, jobs_per_hour: 10, sizes: {}}"),
                "workload.synthetic.teams[0].sizes must have weights",
                id="no sizes",
            ),
            pytest.param(
                synthetic_yaml("{id: a, jobs_per_hour: 10, priorities: {}}"),
                "workload.synthetic.teams[0].priorities must have weights",
                id="no priorities",
            ),
        ],
    )
    def test_impossible_values_are_refused(self, tmp_path: Path, text: str, want: str) -> None:
        result = run_cli(str(write(tmp_path, text)), "--out", str(tmp_path / "out"))
        assert result.exit_code == 2
        assert want in result.output

    @pytest.mark.parametrize(
        ("teams", "want"),
        [
            pytest.param(
                "teams:\n  - {id: a, guaranteed_gpus: {A100: 100}}\n"
                "  - {id: b, guaranteed_gpus: {A100: 100}}\n",
                "teams: guaranteed_gpus[A100] sum to 200, more than the fleet's 16 A100 GPUs",
                id="oversubscribed",
            ),
            pytest.param(
                "teams:\n  - {id: a, guaranteed_gpus: {Z99: 8}}\n"
                "  - {id: b, guaranteed_gpus: {A100: 8}}\n",
                "teams[0].guaranteed_gpus[Z99]: team 'a' is guaranteed 8 Z99 GPUs, but the "
                "fleet has no Z99",
                id="missing type",
            ),
        ],
    )
    def test_doubtful_guarantees_are_warned(self, tmp_path: Path, teams: str, want: str) -> None:
        out = tmp_path / "out"
        result = run_cli(str(write(tmp_path, CLUSTER + teams + JOBS)), "--out", str(out))
        assert result.exit_code == 0, result.output
        warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
        assert len(warned) == 1 and want in warned[0], result.stderr
        assert any(want in w for w in report(out)["warnings"])

    def test_a_guarantee_that_fits_is_not_warned(self, tmp_path: Path) -> None:
        out = tmp_path / "out"
        result = run_cli(str(write(tmp_path, CLUSTER + TEAMS + JOBS)), "--out", str(out))
        assert result.exit_code == 0, result.output
        assert "warning" not in result.stderr
        assert "warnings" not in report(out)

    def test_a_philly_capacity_rounded_up_is_warned(self, tmp_path: Path) -> None:
        """``capacity: 0.001`` silently became one node per VC."""
        vcs = write(tmp_path, "vc,node num\ne13805,200\n7f04ca,2\n", "vcs.csv")
        sample = HERE / "data" / "philly_sample.csv"
        text = (
            f"cluster:\n  philly_vcs: {{path: {vcs}, capacity: 0.01}}\n"
            f"workload:\n  philly: {{path: {sample}, end: '2017-10-02 00:00:00'}}\n"
        )
        sc = load_scenario(write(tmp_path, text))
        assert sum(g.count for g in sc.groups) == 3  # 2 and 1 (raised from 0.02)
        assert len(sc.warnings) == 1
        assert (
            "cluster.philly_vcs.capacity: 0.01 gives 1 of 2 VCs less than one node"
            in (sc.warnings[0])
        )
        assert "the fleet is 3 nodes / 24 GPUs" in sc.warnings[0]
        text = text.replace("0.01", "0.5")
        assert load_scenario(write(tmp_path, text)).warnings == ()


def cli_error(tmp_path: Path, text: str) -> str:
    """The one line ``sim run`` prints for a scenario it refuses (exit 2, no traceback)."""
    result = run_cli(str(write(tmp_path, text)), "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "Error:" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


class TestNodeIds:
    """Two node groups named ``a`` (2 x 8 GPUs each) became 2 nodes in the fleet while the
    header and report.json said 4 nodes / 32 GPUs: a node id is the group's name."""

    def test_a_group_name_used_twice_names_the_field(self, tmp_path: Path) -> None:
        groups = (
            "cluster:\n  node_groups:\n"
            "    - {name: a, count: 2, gpus_per_node: 8, gpu_type: A100}\n"
            "    - {name: a, count: 2, gpus_per_node: 8, gpu_type: A100}\n"
        )
        line = cli_error(tmp_path, groups + TEAMS + JOBS)
        assert "cluster.node_groups[1].name: node group 'a' is declared twice" in line

    def test_a_node_id_of_another_group_names_the_field(self, tmp_path: Path) -> None:
        groups = (
            "cluster:\n  node_groups:\n"
            "    - {name: a, count: 2, gpus_per_node: 8, gpu_type: A100}\n"
            "    - {name: a-0001, count: 1, gpus_per_node: 8, gpu_type: A100}\n"
        )
        line = cli_error(tmp_path, groups + TEAMS + JOBS)
        assert "cluster.node_groups[1].name: node 'a-0001' is also a node of" in line

    def test_a_group_named_like_the_philly_nodes(self, tmp_path: Path) -> None:
        vcs = write(tmp_path, "vc,node num\ne13805,2\n", "vcs.csv")
        sample = HERE / "data" / "philly_sample.csv"
        text = (
            f"cluster:\n  philly_vcs: {{path: {vcs}}}\n"
            "  node_groups: [{name: philly-0001, gpus_per_node: 8}]\n"
            f"workload:\n  philly: {{path: {sample}, end: '2017-10-02 00:00:00'}}\n"
        )
        with pytest.raises(ScenarioError, match=r"cluster.philly_vcs .*'philly-0001' is also"):
            load_scenario(write(tmp_path, text))

    def test_trace_files_listing_a_node_or_vc_twice(self, tmp_path: Path) -> None:
        nodes = write(
            tmp_path,
            "sn,cpu_milli,memory_mib,gpu,model\nn1,96000,1024,8,T4\nn1,96000,1024,8,T4\n",
            "nodes.csv",
        )
        text = f"cluster: {{openb_nodes: {nodes}}}\n" + JOBS
        with pytest.raises(ScenarioError, match=r"openb_nodes: .*'n1' is listed twice"):
            load_scenario(write(tmp_path, text))
        vcs = write(tmp_path, "vc,node num\ne13805,2\ne13805,3\n", "vcs.csv")
        text = f"cluster: {{philly_vcs: {{path: {vcs}}}}}\n" + JOBS
        with pytest.raises(ScenarioError, match=r"philly_vcs.path: .*'e13805' is listed twice"):
            load_scenario(write(tmp_path, text))


def jobs_yaml(*jobs: str) -> str:
    return CLUSTER + TEAMS + "workload:\n  jobs:\n" + "".join(f"    - {j}\n" for j in jobs)


class TestJobFields:
    """``depends_on: 5`` gave ``TypeError: 'int' object is not iterable``; a job depending on
    itself ran, a two-job cycle ended with "2 jobs unfinished"; ``failures: 1000000`` looked
    like a hang."""

    @pytest.mark.parametrize("value", ["5", "true", "false", "0", "{a: b}", "1.5"])
    def test_depends_on_of_another_type_names_the_field(self, tmp_path: Path, value: str) -> None:
        line = cli_error(
            tmp_path,
            jobs_yaml(
                "{id: j0, team: a, duration_s: 10}",
                f"{{id: j1, team: a, duration_s: 10, depends_on: {value}}}",
            ),
        )
        assert "workload.jobs[1].depends_on must be Slurm's 'afterok:ID" in line

    @pytest.mark.parametrize(
        "value", ["afterok:j0", "[{type: afterany, job_id: j0}]", "''", "[]", "null"]
    )
    def test_depends_on_as_text_or_a_list_is_read(self, tmp_path: Path, value: str) -> None:
        sc = load_scenario(
            write(
                tmp_path,
                jobs_yaml(
                    "{id: j0, team: a, duration_s: 10}",
                    f"{{id: j1, team: a, duration_s: 10, depends_on: {value}}}",
                ),
            )
        )
        assert len(next(j for j in sc.jobs if j.job_id == "j1").depends_on) == (
            1 if "j0" in value else 0
        )

    @pytest.mark.parametrize(
        ("jobs", "want"),
        [
            pytest.param(
                ["{id: j1, team: a, duration_s: 10, depends_on: 'afterok:j1'}"],
                "workload.jobs[0].depends_on: job 'j1' depends on itself",
                id="itself",
            ),
            pytest.param(
                ["{id: x, team: a, duration_s: 10, array: 0-3, depends_on: 'afterany:x'}"],
                "workload.jobs[0].depends_on: job 'x' depends on itself",
                id="an array on itself",
            ),
            pytest.param(
                [
                    "{id: big, team: a, duration_s: 10, depends_on: 'afterok:s1'}",
                    "{id: s1, team: b, duration_s: 10, depends_on: 'afterok:big'}",
                ],
                "workload.jobs[0].depends_on: dependency cycle big -> s1 -> big",
                id="two jobs",
            ),
            pytest.param(
                [
                    "{id: a1, team: a, duration_s: 10}",
                    "{id: a2, team: a, duration_s: 10, depends_on: 'afterok:a1,afterany:a4'}",
                    "{id: a3, team: a, duration_s: 10, depends_on: 'afterok:a2'}",
                    "{id: a4, team: a, duration_s: 10, array: 0-1, depends_on: 'afterok:a3'}",
                ],
                "dependency cycle a2 -> a4[0] -> a3 -> a2",
                id="through an array",
            ),
        ],
    )
    def test_a_dependency_cycle_is_refused_naming_the_jobs(
        self, tmp_path: Path, jobs: list[str], want: str
    ) -> None:
        assert want in cli_error(tmp_path, jobs_yaml(*jobs))

    def test_a_chain_and_a_diamond_are_no_cycle(self, tmp_path: Path) -> None:
        sc = load_scenario(
            write(
                tmp_path,
                jobs_yaml(
                    "{id: d1, team: a, duration_s: 10}",
                    "{id: d2, team: a, duration_s: 10, depends_on: 'afterok:d1'}",
                    "{id: d3, team: a, duration_s: 10, array: 0-2, depends_on: 'afterok:d1'}",
                    "{id: d4, team: a, duration_s: 10, depends_on: 'afterok:d2:d3'}",
                ),
            )
        )
        assert len(next(j for j in sc.jobs if j.job_id == "d4").depends_on) == 4

    def test_failures_above_the_limit_names_the_field(self, tmp_path: Path) -> None:
        from gpufleet.sim.scenario_workload import MAX_FAILURES

        ok = f"{{id: j1, team: a, duration_s: 10, failures: {MAX_FAILURES}}}"
        assert load_scenario(write(tmp_path, jobs_yaml(ok))).jobs[0].failures == MAX_FAILURES
        line = cli_error(tmp_path, jobs_yaml(ok.replace(f"{MAX_FAILURES}", "1000000")))
        assert "workload.jobs[0].failures must be an integer >= 0 and <= 1,000" in line


class TestRunOptions:
    def test_help_names_the_scenario_argument(self) -> None:
        """The usage line read ``{config}``."""
        result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "100"})
        assert result.exit_code == 0
        assert "{scenario.yaml}" in result.output and "config" not in result.output

    @pytest.mark.parametrize(
        "args",
        [["--compare", "fifo,no_borrowing"], ["--compare", "fifo", "--compare", " no_borrowing"]],
        ids=["comma-separated", "repeated"],
    )
    def test_compare_takes_a_comma_separated_list(self, tmp_path: Path, args: list[str]) -> None:
        """``--compare fifo,sjf`` was refused; only a repeated option worked."""
        out = tmp_path / "out"
        result = run_cli(str(write(tmp_path, CLUSTER + TEAMS + JOBS)), "--out", str(out), *args)
        assert result.exit_code == 0, result.output
        assert sorted(report(out)["runs"]) == ["fifo", "main", "no_borrowing"]

    @pytest.mark.parametrize("value", ["fifo,bogus", "fifo,,sjf"])
    def test_each_name_of_the_list_is_checked(self, tmp_path: Path, value: str) -> None:
        path = write(tmp_path, CLUSTER + TEAMS + JOBS)
        result = run_cli(str(path), "--out", str(tmp_path / "out"), "--compare", value)
        assert result.exit_code == 2
        assert result.stderr.startswith("error: --compare must be one of")
        assert not (tmp_path / "out" / "report.json").exists()


class TestTeams:
    """Jobs naming teams t1/t2 ran with ``teams: []`` or no ``teams`` key and were refused
    with a non-empty list; and under a partitioning baseline (``sjf``) the never-fit
    warnings blamed one job's size and "teams without guarantees" for the others, when no
    job of a team without nodes could run at all."""

    BIG = "{id: huge, team: t1, gpus: 64, duration_s: 60}"
    SMALL = "{id: s1, team: t2, gpus: 1, duration_s: 60}"

    @pytest.mark.parametrize(
        "teams", ["", "teams:\n", "teams: []\n"], ids=["absent", "null", "[]"]
    )
    def test_without_a_list_the_jobs_imply_the_teams(self, tmp_path: Path, teams: str) -> None:
        text = CLUSTER + teams + "workload:\n  jobs:\n" + f"    - {self.SMALL}\n"
        sc = load_scenario(write(tmp_path, text + f"    - {self.BIG}\n"))
        assert sorted(j.team_id for j in sc.jobs) == ["t1", "t2"]

    def test_a_list_is_every_team_and_a_job_of_another_is_refused(self, tmp_path: Path) -> None:
        text = CLUSTER + "teams: [{id: t1}]\nworkload:\n  jobs:\n" + f"    - {self.SMALL}\n"
        line = cli_error(tmp_path, text)
        assert "workload.jobs (s1).team: team 't2' is not declared in teams: (['t1'])" in line
        assert "leave teams out to have the jobs' teams implied" in line

    def test_never_fit_warnings_say_why_for_each_job(self, tmp_path: Path) -> None:
        text = (
            CLUSTER
            + "teams: [{id: t1}, {id: t2}]\npolicy: {baseline: sjf}\nworkload:\n  jobs:\n"
            + "".join(f"    - {j}\n" for j in (self.BIG, self.SMALL))
            + "    - {id: s2, team: t1, gpus: 1, duration_s: 60}\n"
        )
        out = tmp_path / "out"
        result = run_cli(str(write(tmp_path, text)), "--out", str(out), "--no-plots")
        assert result.exit_code == 0, result.output
        warned = [w for w in result.stderr.splitlines() if w.startswith("warning:")]
        assert warned == [
            f"warning: run main: {n} job{'s' * (n > 1)} can never fit (team {t!r} has no nodes "
            "of its own: it has no guarantee, and this policy runs each team only on nodes "
            "covering its guarantee)"
            for t, n in (("t1", 2), ("t2", 1))
        ]

    def test_a_team_with_nodes_is_told_the_size(self, tmp_path: Path) -> None:
        text = (
            CLUSTER
            + "teams: [{id: t1, guaranteed_gpus: {A100: 16}}]\npolicy: {baseline: sjf}\n"
            + f"workload:\n  jobs:\n    - {self.BIG}\n"
        )
        result = run_cli(str(write(tmp_path, text)), "--out", str(tmp_path / "o"), "--no-plots")
        assert result.exit_code == 0, result.output
        assert "1 job can never fit (more GPUs than the fleet's 16)" in result.stderr


def test_a_grace_period_not_shorter_than_the_hold_timeout_is_warned(tmp_path: Path) -> None:
    """A new user's run: with ``engine.grace_s`` 4000 s and the 3,600-s hold timeout, a
    preemptor's hold expired before its victims stopped, the freed GPUs went to other jobs,
    and one job was preempted 45 times."""
    base = jobs_yaml("{id: j, team: a, gpus: 1, duration_s: 10}")
    sc = load_scenario(write(tmp_path, base + "engine: {grace_s: 4000}\n"))
    assert any(
        "engine.grace_s (4000 s) is not shorter than policy.hold_timeout_s (3600 s)" in w
        for w in sc.warnings
    )
    assert not any("grace_s" in w for w in load_scenario(write(tmp_path, base)).warnings)
