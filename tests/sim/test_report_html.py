"""``sim run`` writes one HTML report with every run overlaid, axis units, and no script."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from gpufleet.sim.cli import run_sim

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"


def test_html_report_overlays_the_baselines_and_is_deterministic(tmp_path: Path) -> None:
    # the example scenario, shortened to 6 simulated hours
    scenario = yaml.safe_load((EXAMPLES / "synthetic_two_teams.yaml").read_text())
    scenario["workload"]["synthetic"]["horizon_h"] = 6
    cfg = tmp_path / "scenario.yaml"
    cfg.write_text(yaml.safe_dump(scenario))
    rep = run_sim(cfg, tmp_path / "a", seed=5, compare=("fifo",))
    page = (tmp_path / "a" / rep["html"]).read_text()
    assert page.count("<svg") == 3  # size CDFs, allocation over time, per-team share
    for label in (
        "queue delay (s, log",
        "fraction of jobs started (0-1)",
        "simulated time (hours)",
        "allocated GPUs",
    ):
        assert label in page, label
    # every run is a line on the same axes: its legend entry appears in each overlay
    for run in ("main", "fifo"):
        assert len(re.findall(rf">{run}\b", page)) >= 2, run
    # nothing to fetch or run: no script, no external reference (SVG namespaces aside)
    assert "<script" not in page and not re.search(r'(src|href)="https?:', page)
    run_sim(cfg, tmp_path / "b", seed=5, compare=("fifo",))
    assert (tmp_path / "b" / "report.html").read_bytes() == page.encode()
