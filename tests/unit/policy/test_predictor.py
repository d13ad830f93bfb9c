"""policy.predictor: rolling quantiles per history level, most specific level first."""

from __future__ import annotations

import math

import pytest

from gpufleet.domain.types import PriorityClass
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.predictor import DurationPredictor, JobKey
from gpufleet.policy.runtime import estimated_end_s
from gpufleet.policy.snapshot import RunningJob


def test_no_history_no_prediction() -> None:
    assert DurationPredictor().predict(JobKey("a", 1)) is None


def test_quantile_of_most_specific_level() -> None:
    p = DurationPredictor(quantile=0.8, window=10, min_samples=3)
    for d in (100, 200, 300, 400, 500):
        p.observe(JobKey("a", 8, "u", "train"), d)
    for d in (10, 10, 10):
        p.observe(JobKey("a", 1, "u", "eval"), d)
    got = p.predict(JobKey("a", 8, "u", "train"))
    assert got is not None
    assert got.seconds == 400  # 4th of 5 sorted: 80% ended at or before it
    assert got.basis == "team+user+name+gpus" and got.samples == 5
    assert got.confidence == pytest.approx(0.5)
    # an unseen name of the same user and size falls back to (team, user, gpus)
    other = p.predict(JobKey("a", 8, "u", "new"))
    assert other is not None and other.basis == "team+user+gpus" and other.seconds == 400
    # an unseen size: the team level mixes both jobs (8 samples)
    team = p.predict(JobKey("a", 2, "v", "x"))
    assert team is not None and team.basis == "team" and team.samples == 8
    assert p.predict(JobKey("b", 1)) is None


def test_window_keeps_recent_and_ignores_bad_values() -> None:
    p = DurationPredictor(quantile=1.0, window=3, min_samples=1)
    for d in (1000, 5, 6, 7, math.inf, -1, 0):
        p.observe(JobKey("a", 1), d)
    got = p.predict(JobKey("a", 1))
    assert got is not None and got.seconds == 7 and got.samples == 3


@pytest.mark.parametrize("kw", [{"quantile": 0}, {"window": 0}, {"min_samples": 5, "window": 4}])
def test_bad_arguments(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"quantile|min_samples"):
        DurationPredictor(**kw)  # type: ignore[arg-type]


def test_running_end_uses_prediction_capped_by_hard_bound() -> None:
    def run(**kw: float) -> RunningJob:
        return RunningJob("r", "j", "a", "n", PriorityClass.NORMAL, 1, "t", 100.0, **kw)

    cfg = PolicyConfig()
    assert estimated_end_s(run(predicted_duration_s=50), 120, cfg) == 150
    assert estimated_end_s(run(predicted_duration_s=50, expected_duration_s=30), 110, cfg) == 130
    assert estimated_end_s(run(predicted_duration_s=500, max_runtime_s=60), 110, cfg) == 160
    assert estimated_end_s(run(), 110, cfg) == math.inf


def test_quantiles_are_the_median_and_p90_at_predicts_level() -> None:
    from gpufleet.policy.predictor import DurationPredictor, JobKey

    p = DurationPredictor(min_samples=3)
    key = JobKey("t", 1)
    assert p.quantiles(key) is None
    for d in (10.0, 20.0, 30.0, 40.0, 1000.0):
        p.observe(key, d)
    q = p.quantiles(key)
    assert q is not None
    assert (q.p50_s, q.p90_s, q.samples, q.basis) == (30.0, 1000.0, 5, "team+user+name+gpus")
    pred = p.predict(key)
    assert pred is not None and pred.basis == q.basis and pred.seconds == 40.0  # its 0.8
