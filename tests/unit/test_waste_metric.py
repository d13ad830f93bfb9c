"""``gpufleet_preemption_waste_gpu_hours_total{team}``: the scheduler counts the work each
preemption's victims lose, per victim team, priced like the waste cap (``policy.waste``)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from gpufleet.controller import metrics
from gpufleet.policy.decisions import Preempt
from tests.unit.policy.policy_builders import node, run, snap


def _value(team: str) -> float:
    got = REGISTRY.get_sample_value("gpufleet_preemption_waste_gpu_hours_total", {"team": team})
    return got or 0.0


def test_a_preemption_counts_its_victims_lost_work_by_team() -> None:
    s = snap(
        nodes=[node("n1", free=0)],
        running=[
            run("v1", "n1", team="waste-metric-a", gpus=4, started=0.0, checkpoint=1800.0),
            run("v2", "n1", team="waste-metric-b", gpus=2, started=0.0),
            run("other", "n1", team="waste-metric-b", gpus=2, started=0.0),
        ],
        now=3600.0,
    )
    before_a, before_b = _value("waste-metric-a"), _value("waste-metric-b")
    metrics.count_waste(s, Preempt("p", "n1", ("v1", "v2"), "priority", 6))
    assert _value("waste-metric-a") - before_a == 2.0  # 4 GPUs x 0.5 h since its checkpoint
    assert _value("waste-metric-b") - before_b == 2.0  # 2 GPUs x 1 h since its start
