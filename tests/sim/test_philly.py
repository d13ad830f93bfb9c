"""Philly 2017: the loader on a checked-in sample, a three-day window with real gangs, and the
full Oct-Nov replay (slow), gangs on whole nodes by default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.sim.calibration import spearman
from gpufleet.sim.cli import run_sim
from gpufleet.sim.loaders import load_philly

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRACES = Path(os.environ.get("GPUFLEET_TRACES_DIR", ROOT.parent / "shared" / "traces"))


class TestLoader:
    @pytest.mark.parametrize(
        ("oversize", "want_kept", "want_max_gpus"),
        [
            pytest.param("gang", 155, 32, id="gangs kept whole (the default)"),
            pytest.param("clip", 155, 8, id="gangs clipped to one node, GPU-time kept"),
            pytest.param("drop", 150, 8, id="gangs dropped"),
        ],
    )
    def test_window_and_oversize(self, oversize: str, want_kept: int, want_max_gpus: int) -> None:
        jobs, stats = load_philly(HERE / "data" / "philly_sample.csv", oversize=oversize)
        assert stats.kept == want_kept
        assert stats.dropped_outside_window == 5
        assert max(j.gpus for j in jobs) == want_max_gpus
        assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
        assert all(j.submit_s >= 0 for j in jobs)

    def test_default_keeps_gangs_whole(self) -> None:
        jobs, stats = load_philly(HERE / "data" / "philly_sample.csv")
        gangs = [j for j in jobs if j.gpus > 8]
        assert stats.gangs == len(gangs) == 5
        assert stats.clipped_oversize == stats.dropped_oversize == 0
        assert not any(j.allow_partial_nodes for j in gangs)  # 16 and 32: whole 8-GPU nodes
        with pytest.raises(ValueError, match="oversize"):
            load_philly(HERE / "data" / "philly_sample.csv", oversize="split")

    def test_clipping_keeps_gpu_time(self) -> None:
        clipped, _ = load_philly(HERE / "data" / "philly_sample.csv", oversize="clip")
        dropped, _ = load_philly(HERE / "data" / "philly_sample.csv", oversize="drop")
        kept = {j.job_id for j in dropped}
        import csv

        with open(HERE / "data" / "philly_sample.csv", newline="") as f:
            raw = {f"p{i:06d}": r for i, r in enumerate(csv.DictReader(f))}
        for j in clipped:
            if j.job_id not in kept:
                r = raw[j.job_id]
                assert j.gpus * j.duration_s == pytest.approx(
                    int(r["num_gpus"]) * float(r["duration"])
                )


def test_spearman() -> None:
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, None, 3, 2], [10, 5, 30, None]) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("xs", "ys"),
    [
        pytest.param([], [], id="no VC"),
        pytest.param([5.0], [7.0], id="one VC"),
        pytest.param([1.0, None], [2.0, 3.0], id="one VC with a mean"),
        pytest.param([4.0, 4.0, 4.0], [1.0, 2.0, 3.0], id="all equal"),
    ],
)
def test_spearman_is_none_when_undefined(xs: list[float | None], ys: list[float]) -> None:
    """It was 0.0 ("no correlation") with no jobs or fewer than two VCs."""
    assert spearman(xs, ys) is None


class TestPublishedSetupOnly:
    """The published FIFO figures were attached to every run of a Philly scenario: a pooled
    fair-share run on a made-up 4 x 8-GPU fleet showed a near-match figure. Now only a run
    of the published setup gets them; the others say why not."""

    def scenario(self, tmp_path: Path, extra: str = "") -> Path:
        from gpufleet.sim.calibration import HELIOS_PHILLY_FIFO

        vcs = tmp_path / "vcs.csv"
        vcs.write_text("vc,node num\n" + "".join(f"{vc},1\n" for vc in HELIOS_PHILLY_FIFO))
        path = tmp_path / "s.yaml"
        path.write_text(
            f"cluster:\n  philly_vcs: {{path: {vcs}{extra}}}\n"
            f"workload:\n  philly: {{path: {HERE / 'data' / 'philly_sample.csv'}}}\n"
            "policy: {baseline: fifo_per_team}\ncompare: [fair_share]\n"
        )
        return path

    def test_fifo_per_vc_gets_them_pooled_does_not(self, tmp_path: Path) -> None:
        rep = run_sim(self.scenario(tmp_path), tmp_path / "out", plots=False)
        main, pooled = rep["runs"]["main"], rep["runs"]["fair_share"]
        cmp = main["philly_vs_published_fifo"]
        assert "philly_vs_published_fifo_skipped" not in main
        assert len(cmp["per_vc"]) == 8 and cmp["spearman_jct"] is not None  # VCs with jobs
        assert "philly_vs_published_fifo" not in pooled
        assert pooled["philly_vs_published_fifo_skipped"] == [
            "the policy is not FIFO per VC (baseline fifo_per_team)"
        ]

    def test_a_scaled_fleet_is_not_the_published_setup(self, tmp_path: Path) -> None:
        rep = run_sim(self.scenario(tmp_path, ", capacity: 2"), tmp_path / "out", plots=False)
        main = rep["runs"]["main"]
        assert "philly_vs_published_fifo" not in main
        assert main["philly_vs_published_fifo_skipped"] == [
            "cluster.philly_vcs.capacity is 2, not 1 (the VC sizes)"
        ]

    def test_node_groups_and_a_short_window(self, tmp_path: Path) -> None:
        path = tmp_path / "s.yaml"
        path.write_text(
            "cluster: {node_groups: [{name: g, count: 4, gpus_per_node: 8}]}\n"
            f"workload:\n  philly: {{path: {HERE / 'data' / 'philly_sample.csv'}, "
            "teams: all, end: '2017-10-02 00:00:00'}\n"
        )
        rep = run_sim(path, tmp_path / "out", plots=False)
        assert rep["runs"]["main"]["philly_vs_published_fifo_skipped"] == [
            "the policy is not FIFO per VC (baseline fifo_per_team)",
            "the fleet is not cluster.philly_vcs (each VC on its own nodes)",
            "the window is 2017-10-01 00:00:00 to 2017-10-02 00:00:00, not Oct-Nov 2017",
        ]


def test_compare_with_helios_without_jobs_is_undefined() -> None:
    from gpufleet.sim.calibration import compare_with_helios

    empty = {"per_team": {}, "queue_delay_s": {"all": {"n": 0}}, "jct_s": {"n": 0}}
    cmp = compare_with_helios(empty)
    assert cmp["spearman_queue_delay"] is None and cmp["spearman_jct"] is None
    assert cmp["orders_of_magnitude_apart_queue_delay"] is None


@pytest.fixture(scope="module")
def philly_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    table = TRACES / "philly_2017" / "philly_jobs_2017-09-04_to_2017-11-30.csv.gz"
    if not table.exists():
        pytest.skip(f"the public traces are not at {TRACES} (set GPUFLEET_TRACES_DIR)")
    out = tmp_path_factory.mktemp("philly")
    return run_sim(
        ROOT / "examples" / "sim" / "philly_fifo_per_vc.yaml",
        out,
        traces_dir=TRACES,
        plots=False,
        compare=("fair_share",),
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # two replays of 68,503 jobs in the class fixture; slow on a loaded host
class TestPhillyReplay:
    """Oct-Nov 2017, 68,503 jobs of the 11 VCs with known sizes, VC x 8 GPUs each.

    What this table reproduces of the published FIFO figures (Helios, SC'21) and what it
    does not is recorded in docs/design/simulator.md; these tests pin both.
    """

    def test_invariants_and_completeness(self, philly_report: dict[str, object]) -> None:
        runs = philly_report["runs"]
        for run in runs.values():  # type: ignore[attr-defined]
            assert run["run"]["invariant_violations"] == 0
            assert run["jobs"]["finished"] == 68_503
        assert runs["main"]["run"]["partitioned"] is True  # type: ignore[index]
        assert runs["fair_share"]["run"]["partitioned"] is False  # type: ignore[index]

    def test_jct_is_the_tables_run_time_at_full_size(
        self, philly_report: dict[str, object]
    ) -> None:
        """At full VC size this table hardly queues (mean wait ~100 s against a mean JCT of
        ~11,600 s), so JCT is the jobs' own run time: matching the published JCT scale and
        ranking checks the job table, not the scheduler. Scheduling is checked at 1/2 and
        1/4 of the VC sizes (test_reference_fifo.py, test_baselines.py)."""
        main = philly_report["runs"]["main"]  # type: ignore[index]
        cmp = main["philly_vs_published_fifo"]
        assert main["queue_delay_s"]["all"]["mean"] < 0.02 * main["jct_s"]["mean"]
        assert cmp["orders_of_magnitude_apart_jct"] <= 1.0
        assert cmp["spearman_jct"] >= 0.4

    @pytest.mark.xfail(
        strict=True,
        reason="at full VC size this job table gives each VC far less load than the Helios "
        "authors' table (6214e9 runs at 9% of its 512 GPUs): the mean wait is ~100 s against "
        "the published 56,531 s (docs/design/simulator.md); queues form at 1/4 of the sizes",
    )
    def test_queue_delay_order_of_magnitude_and_ranking(
        self, philly_report: dict[str, object]
    ) -> None:
        cmp = philly_report["runs"]["main"]["philly_vs_published_fifo"]  # type: ignore[index]
        assert cmp["orders_of_magnitude_apart_queue_delay"] <= 1.0
        assert cmp["spearman_queue_delay"] >= 0.5

    def test_pooled_beside_per_vc(self, philly_report: dict[str, object]) -> None:
        """Pooling (guarantees = VC sizes, borrowing, backfill) reported per VC, beside the
        FIFO per-VC partition; no VC waits longer on average than alone, beyond noise."""
        runs = philly_report["runs"]  # type: ignore[assignment]
        alone = runs["main"]["per_team"]  # type: ignore[index]
        pooled = runs["fair_share"]["per_team"]  # type: ignore[index]
        assert set(alone) == set(pooled)
        for vc in alone:
            assert pooled[vc]["queue_delay_s"]["mean"] <= alone[vc]["queue_delay_s"]["mean"] + 60
        all_alone = runs["main"]["queue_delay_s"]["all"]["mean"]  # type: ignore[index]
        all_pooled = runs["fair_share"]["queue_delay_s"]["all"]["mean"]  # type: ignore[index]
        assert all_pooled < all_alone


@pytest.fixture(scope="module")
def gang_window() -> object:
    """Nov 10-13 2017 of the 11 known VCs: 3,423 jobs, 15 of them gangs of 16-32 GPUs."""
    from gpufleet.policy.config import PolicyConfig
    from gpufleet.sim.config import Scenario
    from gpufleet.sim.engine import EngineOptions
    from gpufleet.sim.loaders import philly_teams, philly_vc_sizes
    from gpufleet.sim.model import NodeGroup

    table = TRACES / "philly_2017" / "philly_jobs_2017-09-04_to_2017-11-30.csv.gz"
    if not table.exists():
        pytest.skip(f"the public traces are not at {TRACES} (set GPUFLEET_TRACES_DIR)")
    vcs = philly_vc_sizes(TRACES / "philly_2017" / "philly_vc_node_count.csv")
    jobs, stats = load_philly(
        table, start="2017-11-10 00:00:00", end="2017-11-13 00:00:00", teams=set(vcs)
    )
    assert stats.clipped_oversize == 0
    assert stats.gangs == sum(1 for j in jobs if j.gpus > 8) == 15
    return Scenario(
        name="philly-gang-window",
        groups=[NodeGroup("philly", sum(vcs.values()), 8, "GPU", cpu=96.0)],
        teams=philly_teams(vcs, 8, "GPU"),
        jobs=jobs,
        policy=PolicyConfig(),
        engine=EngineOptions(check_invariants="every_pass", sample_interval_s=3600.0),
    )


class TestPhillyGangWindow:
    """Three days of the Philly table with the >8-GPU jobs kept whole (the default): every
    gang runs on whole 8-GPU nodes (of its own VC when partitioned), invariants checked after
    every pass. The full two months: ``TestPhillyReplay`` and benchmarks/sim_philly_gangs.py."""

    @pytest.mark.parametrize("baseline", ["fifo_per_team", "fair_share"])
    def test_gangs_on_whole_nodes(self, gang_window: object, baseline: str) -> None:
        from gpufleet.sim.cli import run_scenario
        from gpufleet.sim.config import PARTITION_LABEL, policy_for

        sc = gang_window
        eng, rep = run_scenario(sc, policy_for(sc.base_policy, baseline))  # type: ignore[attr-defined]
        assert eng.violations == 0
        assert rep["jobs"]["finished"] == len(sc.jobs)  # type: ignore[attr-defined]
        gangs = [js for js in eng.fleet.jobs.values() if js.spec.gpus > 8]
        assert eng.gangs_placed >= len(gangs) == 15
        for js in gangs:
            for rid in js.runs:
                run = eng.fleet.runs[rid]
                sizes = sorted((len(m.gpu_ids) for m in run.members), reverse=True)
                assert sizes == [8] * (js.spec.gpus // 8)
                if baseline == "fifo_per_team":
                    nodes = [eng.fleet.nodes[m.node_id] for m in run.members]
                    assert {n.labels[PARTITION_LABEL] for n in nodes} == {js.spec.team_id}
        assert rep["gangs"]["queue_delay_s"]["n"] == len(gangs)


def test_estimate_noise_is_log_normal_and_deterministic() -> None:
    """``estimate_noise`` (issue 29) scales each oracle estimate by exp(N(0, sigma)), the same
    draw on every load; 0 leaves the exact durations."""
    sample = HERE / "data" / "philly_sample.csv"
    exact, _ = load_philly(sample)
    noisy, _ = load_philly(sample, estimate_noise=0.5)
    again, _ = load_philly(sample, estimate_noise=0.5)
    assert [j.expected_duration_s for j in exact] == [j.duration_s for j in exact]
    assert [j.expected_duration_s for j in noisy] == [j.expected_duration_s for j in again]
    assert any(j.expected_duration_s != j.duration_s for j in noisy)
    assert [j.duration_s for j in noisy] == [j.duration_s for j in exact]  # truth kept
