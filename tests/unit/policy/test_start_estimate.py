"""Start estimates of waiting jobs (``policy.start_estimate``): bounded vs unbounded running
work, ranges from the predictor's quantiles, jobs ahead, the policy's reservations first."""

from __future__ import annotations

from policy_builders import job, node, run, snap, team

from gpufleet.policy.cycle import schedule
from gpufleet.policy.predictor import DurationPredictor, JobKey, Spread
from gpufleet.policy.start_estimate import describe, estimate_starts


def estimates(s, spreads=None):  # type: ignore[no-untyped-def]
    return estimate_starts(s, schedule(s), spreads=spreads)


class TestBounded:
    def test_running_work_with_time_limits_gives_a_range_up_to_the_limit(self) -> None:
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0, max_runtime_s=3600)],
            pending=[job("w", gpus=8, at=5)],
            teams=[team("a")],
            now=600,
        )
        e = estimates(s)["w"]
        # only a hard bound: it may end any moment, and no later than its limit
        assert (e.earliest_s, e.latest_s) == (600, 3600)
        assert e.unknown is None and e.ahead == 0
        assert e.basis.endswith("running work bounded by time limits")
        assert describe(e, 600) == (
            "within 50 min; 0 jobs ahead, GPUs reserved for it; running work bounded by"
            " time limits"
        )

    def test_no_limit_and_no_history_is_unknown_and_names_the_job(self) -> None:
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0)],
            pending=[job("w", gpus=8, at=5)],
            teams=[team("a")],
            now=600,
        )
        e = estimates(s)["w"]
        assert e.earliest_s is None and e.latest_s is None
        assert e.unknown is not None and "j-r1" in e.unknown and "max_runtime_s" in e.unknown
        assert describe(e, 600).startswith("unknown because ")

    def test_an_unbounded_job_on_other_gpus_does_not_make_it_unknown(self) -> None:
        s = snap(
            nodes=[node("n1", free=0), node("n2", free=0)],
            running=[
                run("r1", "n1", gpus=8, started=0),
                run("r2", "n2", gpus=8, started=0, max_runtime_s=1000),
            ],
            pending=[job("w", gpus=8, at=5)],
            teams=[team("a")],
            now=100,
        )
        e = estimates(s)["w"]
        assert (e.earliest_s, e.latest_s) == (100, 1000)

    def test_a_job_no_node_could_hold_is_unknown(self) -> None:
        s = snap(nodes=[node("n1", free=8)], pending=[job("w", gpus=2, types=("H100",))], now=0)
        assert estimates(s)["w"].unknown is not None


class TestHistory:
    def test_range_comes_from_the_predictors_quantiles(self) -> None:
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0)],
            pending=[job("w", gpus=8, at=5)],
            teams=[team("a")],
            now=100,
        )
        p = DurationPredictor(window=100, min_samples=3)
        key = JobKey("a", 8)
        for d in range(1000, 2001, 10):  # 1000..2000 s, evenly
            p.observe(key, float(d))
        sp = p.spread(key)
        assert sp is not None and sp.low_s == 1100 and sp.high_s == 1900
        e = estimates(s, lambda _job_id: sp)["w"]
        assert (e.earliest_s, e.latest_s) == (1100, 1900)
        assert e.basis.endswith("running work bounded by the history of similar jobs")

    def test_history_is_capped_by_the_limit(self) -> None:
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0, max_runtime_s=1500)],
            pending=[job("w", gpus=8, at=5)],
            teams=[team("a")],
            now=100,
        )
        e = estimates(s, lambda _job_id: Spread(1000, 4000, 10, "team"))["w"]
        assert (e.earliest_s, e.latest_s) == (1000, 1500)
        assert "time limits" in e.basis and "history" in e.basis

    def test_an_attempt_past_its_high_quantile_runs_as_long_again(self) -> None:
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0)],
            pending=[job("w", gpus=8, at=5)],
            now=5000,
        )
        e = estimates(s, lambda _job_id: Spread(1000, 2000, 10, "team"))["w"]
        assert (e.earliest_s, e.latest_s) == (5000, 10000)


class TestJobsAhead:
    def test_jobs_ahead_add_their_durations_and_are_counted(self) -> None:
        # one 8-GPU node, busy until 1000 at the latest; three 8-GPU jobs wait in order
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0, max_runtime_s=1000)],
            pending=[
                job("w1", gpus=8, at=1, max_runtime_s=500),
                job("w2", gpus=8, at=2, max_runtime_s=500),
                job("w3", gpus=8, at=3, max_runtime_s=500),
            ],
            teams=[team("a")],
            now=0,
        )
        es = estimates(s)
        assert [es[j].ahead for j in ("w1", "w2", "w3")] == [0, 1, 2]
        assert [es[j].latest_s for j in ("w1", "w2", "w3")] == [1000, 1500, 2000]
        assert [es[j].earliest_s for j in ("w1", "w2", "w3")] == [0, 0, 0]

    def test_an_unbounded_job_ahead_makes_the_ones_behind_it_unknown(self) -> None:
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0, max_runtime_s=1000)],
            pending=[job("w1", gpus=8, at=1), job("w2", gpus=8, at=2, max_runtime_s=60)],
            teams=[team("a")],
            now=0,
        )
        es = estimates(s)
        assert es["w1"].latest_s == 1000
        assert es["w2"].unknown is not None and "w1" in es["w2"].unknown
        assert "ahead of it" in es["w2"].unknown

    def test_small_job_uses_gpus_the_big_one_ahead_does_not_need(self) -> None:
        s = snap(
            nodes=[node("n1", free=2), node("n2", free=0)],
            running=[run("r2", "n2", gpus=8, started=0, max_runtime_s=1000)],
            pending=[job("big", gpus=8, at=1, max_runtime_s=100), job("small", gpus=1, at=2)],
            teams=[team("a")],
            now=0,
        )
        result = schedule(s)
        es = estimate_starts(s, result)
        assert "small" not in es  # placed by the pass on a free GPU
        assert es["big"].latest_s == 1000

    def test_a_reserved_job_comes_first_and_says_so(self) -> None:
        s = snap(
            nodes=[node("n1", free=0)],
            running=[run("r1", "n1", gpus=8, started=0, max_runtime_s=1000)],
            pending=[job("big", gpus=8, at=1, max_runtime_s=100)],
            teams=[team("a")],
            now=0,
        )
        e = estimates(s)["big"]
        assert e.reserved and e.basis.startswith("GPUs reserved for it")


def test_describe_formats_ranges() -> None:
    from gpufleet.policy.start_estimate import StartEstimate

    e = StartEstimate(1200, 2700, 3, "running work bounded by time limits")
    assert describe(e, 0) == "in 20-45 min; 3 jobs ahead, running work bounded by time limits"
    assert describe(StartEstimate(7200, 18000, 1, "x"), 0) == "in 2-5 h; 1 job ahead, x"
