"""The Philly workload generator of ``benchmarks/fleet_workload.py`` (``fleet_scale.py
--workload philly``): deterministic for a seed, the backlog it aims for reached, guarantees
summing to the share of each GPU type asked for, gangs kept whole. A small synthetic trace
in the Philly table's format (``/work/shared/traces/README.md`` 1.1) is written per test;
one test reads the real trace when it is there."""

from __future__ import annotations

import gzip
import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fleet_workload", ROOT / "benchmarks" / "fleet_workload.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fleet_workload"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


fw = _load()

VCS = ("aaaaaa", "bbbbbb", "cccccc", "dddddd", "eeeeee", "ffffff", "gggggg")


def write_trace(path: Path, n: int = 3000, seed: int = 1) -> Path:
    """``n`` jobs over 10 days in the Philly table's columns (rows not time-sorted, as the
    real file): sizes 1-32 GPUs, log-normal durations, VCs with skewed demand."""
    rng = random.Random(seed)
    lines = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    for _ in range(n):
        t = rng.uniform(0, 10 * 86400)
        day, rest = divmod(int(t), 86400)
        hh, rest = divmod(rest, 3600)
        mm, ss = divmod(rest, 60)
        gpus = rng.choices((1, 2, 4, 8, 12, 16, 32), (80, 5, 5, 5, 1, 2, 1))[0]
        dur = round(min(4e5, rng.lognormvariate(7, 2)), 1)
        vc = rng.choices(VCS, (40, 20, 15, 10, 8, 5, 2))[0]
        lines.append(
            f"2017-10-{1 + day:02d} {hh:02d}:{mm:02d}:{ss:02d},{dur},{gpus},{dur * gpus},{vc}"
        )
    lines.append("2017-09-20 10:00:00,100.0,1,100.0,aaaaaa")  # before the window: dropped
    lines.append("2017-10-02 10:00:00,100.0,0,0.0,aaaaaa")  # no GPU: dropped
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trace(tmp_path: Path) -> list:
    return fw.read_philly(write_trace(tmp_path / "philly.csv.gz"))


def test_read_philly_sorts_and_filters(trace: list) -> None:
    assert len(trace) == 3000
    assert [j.t_s for j in trace] == sorted(j.t_s for j in trace)
    assert all(j.gpus >= 1 and j.t_s >= 0 for j in trace)


def test_same_seed_same_workload_other_seed_other(trace: list) -> None:
    a = fw.generate(trace, 20, backlog=60, seed=3)
    b = fw.generate(trace, 20, backlog=60, seed=3)
    c = fw.generate(trace, 20, backlog=60, seed=4)
    assert a.jobs == b.jobs and a.teams == b.teams and a.stats == b.stats
    assert a.jobs != c.jobs


@pytest.mark.parametrize(("nodes", "backlog"), [(10, 30), (20, 100), (40, 200)])
def test_fill_phase_reaches_the_backlog_it_aims_for(trace: list, nodes: int, backlog: int) -> None:
    wl = fw.generate(trace, nodes, backlog=backlog, fill_s=30, steady_s=20, seed=0)
    jobs = wl.jobs
    sub = [j.submit_s for j in jobs]
    assert sub == sorted(sub)
    fill = [j for j in jobs if j.phase == "fill"]
    assert fill and all(0 <= j.submit_s <= 30 for j in fill)
    assert all(30 < j.submit_s <= 50 for j in jobs if j.phase == "steady")
    starts = fw.ideal_starts(sub, [j.gpus for j in jobs], [j.run_s for j in jobs], 8 * nodes)
    assert fw.backlog_at(sub, starts, 30) == wl.stats["ideal_backlog_at_fill_end"]
    assert wl.stats["ideal_backlog_at_fill_end"] >= backlog
    # the steady phase offers the fleet's capacity (GPU-seconds per second)
    work = sum(j.gpus * j.run_s for j in jobs if j.phase == "steady")
    assert 8 * nodes * 20 <= work <= 8 * nodes * 20 + 32 * 90
    # durations compressed into [min_run_s, max_run_s]
    assert all(5.0 <= j.run_s <= 90.0 for j in jobs)


def test_more_backlog_more_jobs(trace: list) -> None:
    small = fw.generate(trace, 20, backlog=20, fill_s=30, steady_s=0)
    large = fw.generate(trace, 20, backlog=200, fill_s=30, steady_s=0)
    assert large.stats["fill_jobs"] > small.stats["fill_jobs"]


def test_teams_from_top_vcs_and_guarantees_sum(trace: list) -> None:
    wl = fw.generate(trace, 33, backlog=50, top_teams=3, guarantee_share=0.8)
    ids = [t.team_id for t in wl.teams]
    demand: dict[str, float] = {}
    for j in trace:
        demand[j.vc] = demand.get(j.vc, 0.0) + j.gpus * j.duration_s
    ranked = sorted(demand, key=lambda v: -demand[v])
    assert ids[:3] == [f"vc-{v}" for v in ranked[:3]]  # by GPU demand
    assert ids[-1] == fw.REST_TEAM and len(ids) == 4
    assert set(wl.teams[-1].vcs) == set(ranked[3:])
    fleet = {g.gpu_type: g.count for g in wl.fleet}
    assert fleet == {"H100": 20, "A100": 10, "L4": 3}  # 60/30/10 of 33
    for gt, count in fleet.items():
        total = sum(t.guaranteed_gpus.get(gt, 0) for t in wl.teams)
        assert total == int(0.8 * count * 8)
    # proportional: more demand, no smaller guarantee
    h = [t.guaranteed_gpus["H100"] for t in wl.teams[:3]]
    assert h == sorted(h, reverse=True)
    assert {j.team for j in wl.jobs} <= set(ids)


def test_gangs_kept_whole_and_bodies(trace: list) -> None:
    wl = fw.generate(trace, 20, backlog=400, fill_s=30, steady_s=10, high_share=0.2)
    gangs = [j for j in wl.jobs if j.gang]
    assert gangs, "the synthetic trace has jobs above 8 GPUs"
    for j in gangs:
        b = j.body()
        assert b["gpu_count"] == j.gpus and "gpu_type" not in b
        assert b.get("allow_partial_nodes", False) == (j.gpus % 8 != 0)
    assert any(j.priority == "HIGH" for j in wl.jobs)
    one = wl.jobs[0].body()
    assert one["env"]["HOLLOW_RUN_S"] == f"{wl.jobs[0].run_s:g}"
    assert one["expected_duration_s"] == wl.jobs[0].run_s


def test_apportion_is_exact() -> None:
    assert fw.apportion(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert sum(fw.apportion(101, {"a": 0.37, "b": 0.21, "c": 0.42}).values()) == 101
    assert fw.apportion(5, {"a": 0, "b": 0}) == {"a": 0, "b": 0}


def test_histogram_quantile() -> None:
    a = {0.01: 0.0, 0.1: 0.0, float("inf"): 0.0}
    b = {0.01: 50.0, 0.1: 100.0, float("inf"): 100.0}
    assert fw.histogram_quantile(0.5, a, b) == pytest.approx(0.01)
    assert fw.histogram_quantile(0.75, a, b) == pytest.approx(0.055)
    assert fw.histogram_quantile(0.5, b, b) != fw.histogram_quantile(0.5, b, b)  # NaN


def _real_trace() -> Path | None:
    import os

    for base in (os.environ.get("GPUFLEET_TRACES_DIR"), ROOT.parent / "shared" / "traces"):
        if base and (Path(base) / fw.PHILLY_JOBS).is_file():
            return Path(base) / fw.PHILLY_JOBS
    return None


@pytest.mark.skipif(_real_trace() is None, reason="the Philly trace is not here")
def test_real_trace_100_nodes() -> None:
    path = _real_trace()
    assert path is not None
    trace = fw.read_philly(path)
    assert len(trace) > 60_000  # Oct-Nov 2017: 68,5xx jobs (README 1.1)
    wl = fw.generate(trace, 100, backlog=500, seed=0)
    assert wl.stats["ideal_backlog_at_fill_end"] >= 500
    assert len(wl.teams) == 6 and wl.teams[-1].team_id == fw.REST_TEAM
    assert {g.gpu_type: g.count for g in wl.fleet} == {"H100": 60, "A100": 30, "L4": 10}
