"""FIFO : SJF : QSSF : SRTF on two weeks of the Philly table at 1/4 of the VC sizes: the trends
the published figures show (Helios, SC'21, ../shared/traces/README.md section 9), checked as
ratios and per-VC directions, never as absolute seconds (their job table is not this one).
Full two months at 1/4 and 1/2: benchmarks/sim_philly_baselines.py, docs/design/simulator.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpufleet.policy.config import PolicyConfig
from gpufleet.sim.calibration import (
    HELIOS_PHILLY_FIFO,
    HELIOS_PHILLY_FIFO_ALL,
    HELIOS_PHILLY_SJF,
    HELIOS_PHILLY_SJF_ALL,
)
from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import Scenario, policy_for
from gpufleet.sim.engine import EngineOptions
from gpufleet.sim.loaders import load_philly, philly_teams, philly_vc_sizes
from gpufleet.sim.model import NodeGroup

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRACES = Path(os.environ.get("GPUFLEET_TRACES_DIR", ROOT.parent / "shared" / "traces"))
TABLE = TRACES / "philly_2017" / "philly_jobs_2017-09-04_to_2017-11-30.csv.gz"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    """Oct 1-15 2017, 24,134 jobs, each VC alone on 1/4 of its nodes (704 GPUs), true
    durations known, 1-minute checkpoints; the four baselines one after another."""
    if not TABLE.exists():
        pytest.skip(f"the public traces are not at {TRACES} (set GPUFLEET_TRACES_DIR)")
    vcs = philly_vc_sizes(TRACES / "philly_2017" / "philly_vc_node_count.csv")
    sizes = {vc: max(1, round(n * 0.25)) for vc, n in vcs.items()}
    jobs, _ = load_philly(
        TABLE,
        start="2017-10-01 00:00:00",
        end="2017-10-15 00:00:00",
        teams=set(vcs),
        checkpoint_s=60.0,
    )
    sc = Scenario(
        name="philly-2w-quarter",
        groups=[NodeGroup("philly", sum(sizes.values()), 8, "GPU", cpu=96.0)],
        teams=philly_teams(sizes, 8, "GPU"),
        jobs=jobs,
        policy=PolicyConfig(),
        # invariants at the end of each run (every pass: test_reference_fifo.py)
        engine=EngineOptions(check_invariants="end", sample_interval_s=0.0),
    )
    out = {}
    for name in ("fifo_per_team", "sjf", "qssf", "srtf"):
        eng, rep = run_scenario(sc, policy_for(sc.base_policy, name))
        assert eng.violations == 0
        assert rep["jobs"]["finished"] + rep["jobs"]["rejected_never_fit"] == len(jobs)
        out[name] = rep
    return out


def _wait(rep: dict[str, Any]) -> float:
    return float(rep["queue_delay_s"]["all"]["mean"])


def _jct(rep: dict[str, Any]) -> float:
    return float(rep["jct_s"]["mean"])


def test_order_fifo_qssf_sjf_srtf(runs: dict[str, dict[str, Any]]) -> None:
    """Mean JCT and wait fall from FIFO to QSSF (predictions) to SJF (true durations) to
    SRTF (true remaining time, preemptive): the published ordering of these policies."""
    fifo, qssf, sjf, srtf = (runs[n] for n in ("fifo_per_team", "qssf", "sjf", "srtf"))
    assert _wait(fifo) > 3600  # not vacuous: FIFO queues for hours
    assert _jct(fifo) > _jct(qssf) > _jct(sjf) > _jct(srtf)
    assert _wait(fifo) > _wait(qssf) > _wait(sjf)
    assert srtf["preemption"]["count"] > 0
    for name in ("fifo_per_team", "qssf", "sjf"):
        assert runs[name]["preemption"]["count"] == 0


def test_sjf_to_fifo_jct_ratio_within_2x_of_published(runs: dict[str, dict[str, Any]]) -> None:
    """SJF / FIFO mean JCT: published 34,272 / 86,072 = 0.40. The wait ratio is not within
    2x (published 0.084; here the FIFO queues are shorter: docs/design/simulator.md)."""
    published = HELIOS_PHILLY_SJF_ALL[1] / HELIOS_PHILLY_FIFO_ALL[1]
    ours = _jct(runs["sjf"]) / _jct(runs["fifo_per_team"])
    assert published / 2 <= ours <= published * 2


def test_per_vc_sjf_never_waits_longer_where_fifo_queues(
    runs: dict[str, dict[str, Any]],
) -> None:
    """Published: SJF's mean wait is at most FIFO's in each of the 11 VCs. Here too, in each
    VC whose FIFO wait is more than ten minutes (where there is a queue to reorder)."""
    assert all(HELIOS_PHILLY_SJF[v][0] <= HELIOS_PHILLY_FIFO[v][0] for v in HELIOS_PHILLY_FIFO)
    fifo = runs["fifo_per_team"]["per_team"]
    sjf = runs["sjf"]["per_team"]
    queued = [v for v in fifo if fifo[v]["queue_delay_s"]["mean"] > 600]
    assert len(queued) >= 3
    for vc in queued:
        assert sjf[vc]["queue_delay_s"]["mean"] <= fifo[vc]["queue_delay_s"]["mean"]
