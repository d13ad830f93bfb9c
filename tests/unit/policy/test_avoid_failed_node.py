"""Soft anti-affinity: a job whose last attempt failed to start on a node is placed on another
node that fits, and on that node only when none other does."""

from __future__ import annotations

from dataclasses import replace

from policy_builders import job, node, snap, team

from gpufleet.policy.config import Placement, PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place


def placed_on(result: object, job_id: str) -> str | None:
    return next(
        (
            d.node_id
            for d in result.decisions  # type: ignore[attr-defined]
            if isinstance(d, Place) and d.job_id == job_id
        ),
        None,
    )


def retry(job_id: str, gpus: int, failed_on: str):
    return replace(job(job_id, gpus=gpus), attempt=1, avoid_node_id=failed_on)


def test_the_retry_goes_to_another_equally_good_node() -> None:
    nodes = [node("n1", free=4), node("n2", free=4), node("n3", free=4)]
    fresh = snap(nodes, pending=[job("j", gpus=2)], teams=[team("a")])
    assert placed_on(schedule(fresh), "j") == "n1"  # the tie goes by node id
    again = snap(nodes, pending=[retry("j", 2, "n1")], teams=[team("a")])
    assert placed_on(schedule(again), "j") == "n2"


def test_the_retry_takes_a_worse_fit_rather_than_the_failed_node() -> None:
    # n1 fits exactly; only n2 (6 free) is left: soft anti-affinity beats best fit
    nodes = [node("n1", free=2), node("n2", free=6)]
    s = snap(nodes, pending=[retry("j", 2, "n1")], teams=[team("a")])
    assert placed_on(schedule(s), "j") == "n2"


def test_the_failed_node_is_taken_when_no_other_fits() -> None:
    nodes = [node("n1", free=4), node("n2", free=1)]
    s = snap(nodes, pending=[retry("j", 2, "n1")], teams=[team("a")])
    assert placed_on(schedule(s), "j") == "n1"


def test_spread_also_avoids_it() -> None:
    nodes = [node("n1", free=8), node("n2", free=4)]
    cfg = PolicyConfig(placement=Placement.SPREAD)
    s = snap(nodes, pending=[retry("j", 2, "n1")], teams=[team("a")])
    assert placed_on(schedule(s, cfg), "j") == "n2"


def test_other_jobs_are_not_steered_by_it() -> None:
    nodes = [node("n1", free=4), node("n2", free=4)]
    s = snap(nodes, pending=[retry("j", 2, "n1"), job("k", gpus=2)], teams=[team("a")])
    out = schedule(s)
    # k is best-fit onto what j left of n2 (2 free), not pushed off n1's node or onto it
    assert placed_on(out, "j") == "n2" and placed_on(out, "k") == "n2"
    s = snap(nodes, pending=[job("k", gpus=2)], teams=[team("a")])
    assert placed_on(schedule(s), "k") == "n1"
