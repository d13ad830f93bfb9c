"""Bad scenarios get one clear line and exit 2, never a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.sim import cli as sim_cli
from gpufleet.sim.cli import app
from gpufleet.sim.config import BASELINES, ScenarioError

GOOD_CLUSTER = (
    "cluster:\n  node_groups:\n    - {name: g, count: 2, gpus_per_node: 8, gpu_type: H100}\n"
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        pytest.param("- a\n- b\n", "mapping", id="a list instead of a mapping"),
        pytest.param("teamz: []\n" + GOOD_CLUSTER, "unknown keys", id="misspelled key"),
        pytest.param(
            GOOD_CLUSTER + "teams:\n  - {id: t1, weight: -1}\n", "weight", id="negative weight"
        ),
        pytest.param(
            GOOD_CLUSTER + "teams:\n  - {id: t1, weight: .inf}\n", "weight", id="infinite weight"
        ),
        pytest.param(
            GOOD_CLUSTER + "teams:\n  - {id: t1, guaranteed_gpus: {H100: -4}}\n",
            "guaranteed_gpus",
            id="negative guarantee",
        ),
        pytest.param(
            GOOD_CLUSTER + "workload:\n  philly: {path: philly_2017/nothere.csv}\n",
            "not found",
            id="missing trace file",
        ),
        pytest.param("cluster: [\n", "YAML", id="invalid YAML"),
        pytest.param(
            GOOD_CLUSTER
            + "workload:\n  philly: {path: x.csv, estimate: none, estimate_noise: 0.5}\n",
            "estimate_noise needs estimate: exact",
            id="noise without the oracle",
        ),
    ],
)
def test_bad_scenarios_are_one_line_errors(tmp_path: Path, text: str, want: str) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text(text)
    result = CliRunner().invoke(
        app, ["run", str(cfg), "--out", str(tmp_path / "out"), "--traces-dir", str(tmp_path)]
    )
    assert result.exit_code == 2, result.output
    assert want in result.output
    assert "Traceback" not in result.output


def test_progress_without_a_terminal_is_plain_lines(tmp_path: Path) -> None:
    """`sim run` in a pipe (CliRunner is not a terminal) reports each run's progress as
    plain lines on stderr, ending at 100%, besides the results on stdout."""
    cfg = tmp_path / "s.yaml"
    cfg.write_text(
        GOOD_CLUSTER
        + "teams:\n  - {id: t1, guaranteed_gpus: {H100: 16}}\n"
        + "workload:\n  synthetic:\n    horizon_h: 6\n    teams:\n"
        + "      - {id: t1, jobs_per_hour: 400, sizes: {1: 1.0}, median_duration_s: 600}\n"
        + "engine: {check_invariants: every_pass}\n"
    )
    result = CliRunner().invoke(
        app, ["run", str(cfg), "--out", str(tmp_path / "out"), "--no-plots", "--compare", "fifo"]
    )
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if line.startswith("sim ")]
    for run in ("main", "fifo"):
        lines = [line for line in progress if line.startswith(f"sim {run}: ")]
        assert len(lines) >= 2, progress  # a step before the end, not only the final line
        assert lines[-1].startswith(f"sim {run}: 100%"), progress
        # the 100% line comes once, when the run has ended, with the time it ended at
        # (it came when the last job arrived, and the queue then drained unreported)
        assert sum(line.startswith(f"sim {run}: 100%") for line in lines) == 1
        report = json.loads((tmp_path / "out" / "report.json").read_text())
        end_h = report["runs"][run]["run"]["sim_end_s"] / 3600
        assert lines[-1] == f"sim {run}: 100% (simulated {end_h:.1f}h)", progress
    assert "report:" in result.stdout


class TestUnknownBaseline:
    """A new-user trial: ``--compare bogus`` ran the whole main simulation, then failed with
    ``...: ValueError: unknown baseline 'bogus'``."""

    EXAMPLE = Path(__file__).parents[2] / "examples" / "sim" / "synthetic_two_teams.yaml"

    @staticmethod
    def _no_run(monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(*_a: object, **_k: object) -> None:
            raise AssertionError("the scenario was read or run before --compare was checked")

        monkeypatch.setattr(sim_cli, "load_scenario", refuse)
        monkeypatch.setattr(sim_cli, "run_scenario", refuse)

    @pytest.mark.parametrize(
        "compare",
        [
            pytest.param(["bogus"], id="one unknown"),
            pytest.param(["fifo", "bogus"], id="a good one then an unknown one"),
        ],
    )
    def test_cli_refuses_before_any_run(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compare: list[str]
    ) -> None:
        self._no_run(monkeypatch)
        args = [a for name in compare for a in ("--compare", name)]
        result = CliRunner().invoke(
            app, ["run", str(self.EXAMPLE), "--out", str(tmp_path / "out"), *args]
        )
        assert result.exit_code == 2, result.output
        assert "--compare" in result.stderr and "'bogus'" in result.stderr
        for name in BASELINES:
            assert name in result.stderr
        assert "ValueError" not in result.output and "Traceback" not in result.output
        assert not (tmp_path / "out").exists()

    def test_run_sim_refuses_before_reading_the_scenario(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._no_run(monkeypatch)
        with pytest.raises(ScenarioError, match=r"^compare must be one of .*fifo.*'bogus'"):
            sim_cli.run_sim(self.EXAMPLE, tmp_path / "out", compare=("bogus",))

    def test_scenario_compare_list_fails_at_load(self, tmp_path: Path) -> None:
        cfg = tmp_path / "s.yaml"
        text = self.EXAMPLE.read_text()
        cfg.write_text(re.sub(r"(?m)^compare:.*$", "compare: [fifo, bogus]", text))
        result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "out")])
        assert result.exit_code == 2, result.output
        assert "compare[1] must be one of" in result.stderr and "'bogus'" in result.stderr
        assert "sim main" not in result.stderr  # no run started
        assert "ValueError" not in result.output
