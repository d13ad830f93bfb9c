"""Bad scenarios get one clear line and exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.sim.cli import app

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
    assert "report:" in result.stdout
