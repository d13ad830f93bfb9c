"""The indexed lookups give the answers of a scan over every node.

* a ``FleetIndex`` kept up to date with ``update`` (what the simulator does between passes)
  equals one built from scratch, and a pass given it decides exactly as a pass without it;
* ``find_reservation`` (free lists, then the fleet-wide walk of estimated ends) picks the
  node and shadow that computing :func:`start_on_node` for every accepting node picks;
* a gang of whole-node members reads the same starts from the free lists and the nodes'
  last estimated ends as from every accepting node.
"""

from __future__ import annotations

import math
from dataclasses import replace

import policy_builders as b
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import snapshots

from gpufleet.policy.backfill import (
    _member_starts,
    _whole_node_starts,
    find_reservation,
    has_reservation_candidate,
    start_on_node,
)
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.fleet_index import FleetIndex, node_accepts
from gpufleet.policy.placement import FreeIndex, Shadow
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.snapshot import ClusterSnapshot, NodeState, PendingJob


def scan_reservation(
    job: PendingJob, index: FreeIndex, running: RunningIndex, now_s: float
) -> tuple[str, Shadow] | None:
    """The rule by brute force: every schedulable, unreserved, accepting node."""
    res = job.resources
    prefs = {t: i for i, t in enumerate(res.gpu_types)}
    best: tuple[float, int, int, str] | None = None
    for node_id, node in index.nodes.items():
        if not node.schedulable or node_id in index.shadows:
            continue
        if not node_accepts(node, res, job.node_selector):
            continue
        start, extra = start_on_node(job, node_id, index, running, now_s)
        if start == math.inf:
            continue
        key = (start, prefs.get(node.gpu_type, 0), extra, node_id)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    start, _, extra, node_id = best
    return node_id, Shadow(job.job_id, start, res.gpu_count, extra)


@settings(max_examples=200, deadline=None)
@given(snapshots(), st.data())
def test_updated_fleet_index_equals_a_fresh_one(
    sc: tuple[ClusterSnapshot, PolicyConfig], data: st.DataObject
) -> None:
    snap, cfg = sc
    # start from another state of the same nodes (all idle), then update every node
    idle = [replace(n, free_gpus=n.total_gpus) for n in snap.nodes]
    index = FleetIndex(idle)
    order = data.draw(st.permutations(list(snap.nodes)))
    for n in order:
        index.update(n)
    fresh = FleetIndex(snap.nodes)
    assert {t: keys for t, keys in index.lists.items() if keys} == fresh.lists
    assert {t: f for t, f in index.free_by_type.items() if f} == fresh.free_by_type
    with_index = schedule(replace(snap, fleet_index=index), cfg)
    without = schedule(snap, cfg)
    assert with_index.decisions == without.decisions
    assert dict(with_index.waiting) == dict(without.waiting)
    assert with_index.released_holds == without.released_holds


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.data())
def test_find_reservation_equals_a_scan_of_every_node(
    sc: tuple[ClusterSnapshot, PolicyConfig], data: st.DataObject
) -> None:
    snap, cfg = sc
    index = FreeIndex(snap.nodes)
    running = RunningIndex(snap.running, snap.now_s, cfg)
    # some nodes already reserved for another job, as later heads of a pass see them
    for n in snap.nodes:
        if data.draw(st.booleans()):
            index.add_shadow(n.node_id, Shadow("other", snap.now_s + 10, 1, 0))
    for job in snap.pending:
        assert find_reservation(job, index, running, snap.now_s) == scan_reservation(
            job, index, running, snap.now_s
        )
        scan_candidate = any(
            n.schedulable
            and n.node_id not in index.shadows
            and node_accepts(n, job.resources, job.node_selector)
            for n in snap.nodes
        )
        assert has_reservation_candidate(job, index) == scan_candidate


@st.composite
def labelled_states(draw: st.DrawFn) -> tuple[list[list[NodeState]], list[PendingJob]]:
    """Two states of the same labelled nodes (two passes) and jobs, some with a rack or
    zone selector: one-label buckets kept by the FleetIndex across passes."""
    n_nodes = draw(st.integers(1, 8))
    shapes = [
        (
            f"n{i}",
            draw(st.sampled_from(["A100", "H100"])),
            {"rack": draw(st.sampled_from(["r0", "r1", "r2"])), "zone": f"z{i % 2}"},
        )
        for i in range(n_nodes)
    ]
    states = [
        [
            b.node(nid, draw(st.integers(0, 8)), gpu_type=t, labels=labels)
            for nid, t, labels in shapes
        ]
        for _ in range(2)
    ]
    jobs = [
        b.job(
            f"j{i:02d}",
            team=draw(st.sampled_from("ab")),
            gpus=draw(st.sampled_from([1, 2, 4, 8])),
            types=draw(st.sampled_from([(), ("A100",), ("H100",)])),
            selector=draw(
                st.sampled_from(
                    [None, {"rack": "r0"}, {"rack": "r1"}, {"rack": "r2"}, {"zone": "z1"}]
                )
            ),
        )
        for i in range(draw(st.integers(1, 20)))
    ]
    return states, jobs


@settings(max_examples=200, deadline=None)
@given(labelled_states())
def test_fleet_index_buckets_kept_across_passes_decide_as_a_fresh_pass(
    case: tuple[list[list[NodeState]], list[PendingJob]],
) -> None:
    states, jobs = case
    cfg = PolicyConfig()
    index = FleetIndex(states[0])
    for state in states:
        for n in state:
            index.update(n)
        s = b.snap(state, jobs, [], [b.team("a"), b.team("b")], now=100.0)
        with_index = schedule(replace(s, fleet_index=index), cfg)
        without = schedule(s, cfg)
        assert with_index.decisions == without.decisions
        assert dict(with_index.waiting) == dict(without.waiting)


@st.composite
def drained_fleets(draw: st.DrawFn) -> tuple[FreeIndex, RunningIndex, PendingJob, int, float]:
    """Whole 8-GPU nodes of one type, some partly taken, held for the job or another one,
    or reserved, with attempts ending now, later, or never: what a gang head of 8-GPU
    members meets late in a pass."""
    now = 100.0
    nodes, running = [], []
    for i in range(draw(st.integers(1, 12))):
        free = draw(st.sampled_from([0, 0, 2, 8]))
        nodes.append(b.node(f"n{i}", free))
        left = 8 - free
        while left > 0:
            gpus = draw(st.integers(1, left))
            started = draw(st.sampled_from([0.0, 50.0, 90.0]))
            expected = draw(st.sampled_from([None, 10.0, 100.0, 150.0]))
            bound = draw(st.sampled_from([None, 200.0]))
            running.append(
                b.run(f"x{i}-{left}", f"n{i}", gpus=gpus, started=started, expected_s=expected)
            )
            running[-1] = replace(running[-1], max_runtime_s=bound)
            left -= gpus
    index = FreeIndex(nodes)
    for n in nodes:
        what = draw(st.sampled_from(["", "", "take", "hold", "hold_other", "shadow"]))
        if what == "take" and n.free_gpus:
            index.take(n.node_id, b.job("t", gpus=1).resources)
        elif what in ("hold", "hold_other") and n.free_gpus:
            index.hold(n.node_id, "big" if what == "hold" else "other", 8)
        elif what == "shadow":
            index.add_shadow(n.node_id, Shadow("other", now + 10, 8, 0))
    job = b.job("big", gpus=16)
    k = draw(st.integers(1, 4))
    return index, RunningIndex(running, now, PolicyConfig()), job, k, now


@settings(max_examples=300, deadline=None)
@given(drained_fleets())
def test_whole_node_starts_are_the_per_node_starts_a_gang_reads(
    case: tuple[FreeIndex, RunningIndex, PendingJob, int, float],
) -> None:
    """``_whole_node_starts`` (free lists, then nodes by last estimated end) gives the
    first starts of ``_member_starts`` (every node computed): all those ready by the k-th
    earliest, or all of them when fewer than k."""
    index, running, job, k, now = case
    nodes = index.accepting(replace(job.resources, gpu_count=8), {}, "A100")
    every = sorted(_member_starts(job, 8, nodes, index, running, now))
    if len(every) >= k:
        every = [e for e in every if e[0] <= every[k - 1][0]]
    assert sorted(_whole_node_starts(job, 8, k, "A100", nodes, index, running, now)) == every
