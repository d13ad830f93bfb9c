"""Multi-node jobs (gangs) in the pure policy: member split, placement (whole nodes, topology,
one GPU type, all or nothing), quotas on all GPUs, preemption as a unit, backfill hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_builders import node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.domain.types import Resources
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import (
    CycleResult,
    GangMember,
    HoldForBackfill,
    Place,
    PlaceGang,
    Preempt,
)
from gpufleet.policy.gang import _topology_fit, find_gang, gang_members
from gpufleet.policy.placement import FreeIndex, Shadow
from gpufleet.policy.snapshot import BackfillReservation, GpuHold, PendingJob, RunningJob


def gang(
    job_id: str,
    gpus: int,
    team: str = "a",
    nodes: int | None = None,
    per_node: int | None = None,
    partial: bool = False,
    types: tuple[str, ...] = (),
    priority: P = P.NORMAL,
    at: float = 0.0,
    max_runtime_s: float | None = None,
) -> PendingJob:
    return PendingJob(
        job_id=job_id,
        team_id=team,
        priority=priority,
        submitted_at_s=at,
        resources=Resources(
            gpus,
            types,
            nodes=nodes,
            gpus_per_node=per_node,
            allow_partial_nodes=partial,
        ),
        max_runtime_s=max_runtime_s,
    )


def rack(node_id: str, free: int, rack_id: str, switch: str = "") -> object:
    labels: Mapping[str, str] = {"rack": rack_id, **({"switch": switch} if switch else {})}
    return node(node_id, free, labels=labels)


def member_run(
    run_id: str, node_id: str, job_id: str, rank: int, size: int, gpus: int = 8, **kw: object
) -> RunningJob:
    r = run(run_id, node_id, gpus=gpus, **kw)  # type: ignore[arg-type]
    return replace(r, job_id=job_id, rank=rank, gang_size=size)


def gangs(result: CycleResult) -> list[PlaceGang]:
    return [d for d in result.decisions if isinstance(d, PlaceGang)]


def member_nodes(result: CycleResult, job_id: str) -> list[str]:
    (pg,) = [g for g in gangs(result) if g.job_id == job_id]
    return [m.node_id for m in pg.members]


class TestShape:
    @pytest.mark.parametrize(
        ("res", "node_gpus", "want"),
        [
            pytest.param(Resources(4), 8, (4,), id="fits one node: single-node job"),
            pytest.param(Resources(16), 8, (8, 8), id="derived: whole nodes"),
            pytest.param(Resources(64), 8, (8,) * 8, id="64 GPUs on 8-GPU nodes"),
            pytest.param(Resources(12), 8, None, id="uneven without permission: never"),
            pytest.param(
                Resources(12, allow_partial_nodes=True), 8, (8, 4), id="uneven when allowed"
            ),
            pytest.param(Resources(8, nodes=2), 8, (4, 4), id="explicit nodes, derived size"),
            pytest.param(Resources(16, gpus_per_node=4), 8, (4,) * 4, id="explicit per node"),
            pytest.param(Resources(16, gpus_per_node=16), 8, None, id="member over node size"),
            pytest.param(Resources(10, nodes=3), 8, None, id="10 on 3 nodes: not even"),
            pytest.param(
                Resources(10, nodes=3, allow_partial_nodes=True),
                8,
                (4, 3, 3),
                id="10 on 3 nodes when allowed",
            ),
            pytest.param(Resources(12, nodes=2, gpus_per_node=4), 8, None, id="2x4 is not 12"),
        ],
    )
    def test_member_split(self, res: Resources, node_gpus: int, want: object) -> None:
        assert gang_members(res, node_gpus) == want


class TestPlacement:
    def test_whole_free_nodes_first(self) -> None:
        nodes = [node("n1", 6), node("n2", 8), node("n3", 7), node("n4", 8)]
        result = schedule(snap(nodes, [gang("g", 16)]))
        assert gangs(result) == [PlaceGang("g", (GangMember(0, "n2", 8), GangMember(1, "n4", 8)))]

    def test_all_or_nothing_and_smaller_jobs_still_flow(self) -> None:
        nodes = [node("n1", 8), node("n2", 6)]
        pending = [gang("g", 16, at=0), gang("s", 2, team="b", at=1)]
        result = schedule(snap(nodes, pending))
        assert gangs(result) == []
        assert [d.job_id for d in result.decisions if isinstance(d, Place)] == ["s"]
        why = result.waiting["g"]
        assert why.code == "no_node_fits_now"
        assert why.details["gang"] is True

    def test_partial_member_goes_best_fit(self) -> None:
        nodes = [node("n1", 8), node("n2", 5), node("n3", 4), node("n4", 8)]
        result = schedule(snap(nodes, [gang("g", 12, partial=True)]))
        assert gangs(result)[0].members == (GangMember(0, "n1", 8), GangMember(1, "n3", 4))

    def test_one_rack_preferred(self) -> None:
        nodes = [
            rack("a1", 8, "r1"),
            rack("b1", 8, "r2"),
            rack("b2", 8, "r2"),
            rack("c1", 8, "r3"),
        ]
        result = schedule(snap(nodes, [gang("g", 16)]))
        assert member_nodes(result, "g") == ["b1", "b2"]

    def test_one_switch_then_fewest_racks(self) -> None:
        nodes = [
            rack("a1", 8, "r1", "s1"),
            rack("b1", 8, "r2", "s2"),
            rack("c1", 8, "r3", "s2"),
            rack("c2", 8, "r3", "s2"),
            rack("d1", 8, "r4", "s1"),
        ]
        result = schedule(snap(nodes, [gang("g", 24)]))
        # no rack has 3 free nodes; switch s2 has (r3: 2 nodes + r2: 1 node), s1 only 2
        assert sorted(member_nodes(result, "g")) == ["b1", "c1", "c2"]

    def test_never_mixes_gpu_types(self) -> None:
        nodes = [node("a1", 8), node("h1", 8, gpu_type="H100"), node("h2", 4, gpu_type="H100")]
        result = schedule(snap(nodes, [gang("g", 16)]))
        assert gangs(result) == []
        nodes.append(node("h3", 8, gpu_type="H100"))
        result = schedule(snap(nodes, [gang("g", 16)]))
        assert member_nodes(result, "g") == ["h1", "h3"]

    def test_preferred_type_order(self) -> None:
        nodes = [node(f"a{i}", 8) for i in range(2)] + [
            node(f"h{i}", 8, gpu_type="H100") for i in range(2)
        ]
        result = schedule(snap(nodes, [gang("g", 16, types=("H100", "A100"))]))
        assert member_nodes(result, "g") == ["h0", "h1"]

    @pytest.mark.parametrize(
        ("extra", "want_code"),
        [
            pytest.param([], "never_fits", id="24 GPUs, two 8-GPU nodes in the fleet"),
            pytest.param(
                [node("n3", 8, schedulable=False)],
                "no_schedulable_node",
                id="the third node is cordoned",
            ),
        ],
    )
    def test_never_fits_counts_nodes(self, extra: list[object], want_code: str) -> None:
        nodes = [node("n1", 0), node("n2", 0), *extra]
        result = schedule(snap(nodes, [gang("g", 24)]))
        assert result.waiting["g"].code == want_code

    def test_shadows_are_respected_per_member(self) -> None:
        """An earlier job's backfill reservation on n2 keeps an unbounded gang off it."""
        nodes = [node("n1", 8), node("n2", 8), node("n3", 8)]
        s = snap(
            nodes,
            [gang("g", 16, team="b", at=5)],
            running=[],
            teams=[team("a"), team("b")],
        )
        big = PendingJob("big", "a", P.NORMAL, 0.0, Resources(8))
        held = replace(
            s,
            pending=(*s.pending, big),
            reservations=(BackfillReservation("big", "n2", 8, 0.0),),
        )
        result = schedule(held)
        places = {d.job_id: d for d in result.decisions if isinstance(d, Place)}
        assert places["big"].node_id == "n2"
        assert sorted(member_nodes(result, "g")) == ["n1", "n3"]


class TestQuota:
    def test_all_gpus_of_a_gang_count(self) -> None:
        nodes = [node(f"n{i}", 8) for i in range(4)]
        teams = [team("a", guarantee=16, borrow_limit=4)]
        assert gangs(schedule(snap(nodes, [gang("g", 16)], teams=teams)))
        result = schedule(snap(nodes, [gang("g", 24)], teams=teams))
        assert gangs(result) == []
        assert result.waiting["g"].code == "over_borrow_limit"

    def test_drf_charges_the_whole_gang(self) -> None:
        """After a's 16-GPU gang, b (nothing yet) is served before a's next job."""
        nodes = [node(f"n{i}", 8) for i in range(3)]
        pending = [gang("g", 16, team="a", at=0), gang("a2", 8, team="a", at=1)]
        pending.append(gang("b1", 8, team="b", at=2))
        result = schedule(snap(nodes, pending, teams=[team("a"), team("b")]))
        order = [getattr(d, "job_id", "") for d in result.decisions]
        assert order == ["g", "b1"]


class TestPreemption:
    def test_gang_victim_is_stopped_as_a_unit(self) -> None:
        """A HIGH 8-GPU job preempts a LOW gang: every member's run is listed, whatever
        node it is on."""
        running = [
            member_run("g-0", "n1", "g", 0, 2, priority=P.LOW, started=10),
            member_run("g-1", "n2", "g", 1, 2, priority=P.LOW, started=10),
        ]
        s = snap(
            [node("n1", 0), node("n2", 0)],
            [gang("hi", 8, priority=P.HIGH)],
            running=running,
            teams=[team("a", guarantee=16)],
            now=100,
        )
        (pre,) = [d for d in schedule(s).decisions if isinstance(d, Preempt)]
        assert pre.node_id == "n1"
        assert pre.victim_run_ids == ("g-0", "g-1")

    def test_victim_cost_counts_all_members(self) -> None:
        """Freeing 4 GPUs: a 4-GPU single job loses less than one member of a 2 x 4 gang
        (the whole gang stops), so the single job is the victim."""
        running = [
            member_run("g-0", "n1", "g", 0, 2, gpus=4, priority=P.LOW),
            member_run("g-1", "n3", "g", 1, 2, gpus=4, priority=P.LOW),
            run("single", "n2", gpus=4, priority=P.LOW),
            run("f1", "n1", gpus=4, priority=P.HIGH),
            run("f2", "n2", gpus=4, priority=P.HIGH),
            run("f3", "n3", gpus=4, priority=P.HIGH),
        ]
        s = snap(
            [node("n1", 0), node("n2", 0), node("n3", 0)],
            [gang("hi", 4, priority=P.HIGH)],
            running=running,
            teams=[team("a", guarantee=24)],
            now=100,
        )
        (pre,) = [d for d in schedule(s).decisions if isinstance(d, Preempt)]
        assert (pre.node_id, pre.victim_run_ids) == ("n2", ("single",))

    def test_gang_preemptor_preempts_on_several_nodes(self) -> None:
        running = [
            run("l1", "n1", gpus=8, priority=P.LOW),
            run("l2", "n2", gpus=8, priority=P.LOW),
            run("h3", "n3", gpus=8, priority=P.HIGH),
        ]
        s = snap(
            [node("n1", 0), node("n2", 0), node("n3", 0)],
            [gang("big", 16, priority=P.HIGH)],
            running=running,
            teams=[team("a", guarantee=24)],
            now=100,
        )
        result = schedule(s)
        pres = [d for d in result.decisions if isinstance(d, Preempt)]
        assert [(p.node_id, p.victim_run_ids, p.gpu_count) for p in pres] == [
            ("n1", ("l1",), 8),
            ("n2", ("l2",), 8),
        ]
        why = result.waiting["big"]
        assert why.code == "waiting_for_preemption"
        assert why.details["nodes"] == ["n1", "n2"]

    def test_gang_preemptor_all_or_nothing(self) -> None:
        """Only one node has preemptible work: no Preempt at all (a gang never holds part of
        its nodes)."""
        running = [
            run("l1", "n1", gpus=8, priority=P.LOW),
            run("h2", "n2", gpus=8, priority=P.HIGH),
        ]
        s = snap(
            [node("n1", 0), node("n2", 0)],
            [gang("big", 16, priority=P.HIGH)],
            running=running,
            teams=[team("a", guarantee=16)],
            now=100,
        )
        assert [d for d in schedule(s).decisions if isinstance(d, Preempt)] == []

    def test_held_gpus_on_every_member_node_place_the_gang(self) -> None:
        s = snap(
            [node("n1", 8), node("n2", 8), node("n3", 8)],
            [gang("other", 8, team="b", at=0), gang("big", 16, priority=P.HIGH, at=5)],
            teams=[team("a", guarantee=16), team("b")],
            holds=[GpuHold("big", "n2", 8, 90.0, "priority"), GpuHold("big", "n3", 8, 90.0)],
            now=100,
        )
        result = schedule(s)
        assert sorted(member_nodes(result, "big")) == ["n2", "n3"]
        assert [d.node_id for d in result.decisions if isinstance(d, Place)] == ["n1"]

    def test_reclaim_takes_a_borrowed_gang_as_a_unit(self) -> None:
        """a borrows 16 GPUs as one gang on n2+n3; b (guarantee 8) reclaims: one Preempt
        lists both members."""
        running = [
            run("a-own", "n1", team="a", gpus=8, started=0),
            member_run("ag-0", "n2", "ag", 0, 2, team="a", started=50),
            member_run("ag-1", "n3", "ag", 1, 2, team="a", started=50),
        ]
        s = snap(
            [node("n1", 0), node("n2", 0), node("n3", 0)],
            [gang("b1", 8, team="b", at=60)],
            running=running,
            teams=[team("a", guarantee=8), team("b", guarantee=8)],
            now=100,
        )
        (pre,) = [d for d in schedule(s).decisions if isinstance(d, Preempt)]
        assert pre.reason == "reclaim"
        assert pre.victim_run_ids == ("ag-0", "ag-1")


def drain_snapshot(reservations: tuple[BackfillReservation, ...] = ()) -> object:
    """Four busy 8-GPU nodes ending at t=100, 200, 300, 400 (estimates); a 16-GPU gang of
    team b is blocked; team a streams unbounded 1-GPU jobs."""
    running = [run(f"r{i}", f"n{i}", team="a", gpus=7, expected_s=100.0 * i) for i in range(1, 5)]
    pending = [gang("big", 16, team="b", at=0)]
    pending += [gang(f"s{i}", 1, team="a", at=1 + i) for i in range(6)]
    pending.append(gang("short", 1, team="a", at=20, max_runtime_s=50))
    s = snap(
        [node(f"n{i}", 1) for i in range(1, 5)],
        pending,
        running=running,
        teams=[team("a"), team("b")],
        now=10,
    )
    return replace(s, reservations=reservations)


class TestBackfillHold:
    def test_large_gang_holds_the_nodes_that_drain_first(self) -> None:
        result = schedule(drain_snapshot())  # type: ignore[arg-type]
        holds = [d for d in result.decisions if isinstance(d, HoldForBackfill)]
        holds = [h for h in holds if h.job_id == "big"]
        assert holds == [
            HoldForBackfill("big", "n1", 8, 200.0),
            HoldForBackfill("big", "n2", 8, 200.0),
        ]
        why = result.waiting["big"]
        assert why.code == "waiting_with_reservation"
        assert why.estimated_start_s == 200.0
        assert (why.details["nodes_held"], why.details["nodes_needed"]) == (2, 2)
        assert why.details["nodes_ready"] == 0
        # unbounded small jobs stay off the held nodes; a bounded one may use them
        places = {d.job_id: d.node_id for d in result.decisions if isinstance(d, Place)}
        assert set(places.values()) <= {"n1", "n2", "n3", "n4"}
        assert all(places[j] in ("n3", "n4") for j in places if j != "short")
        assert "short" in places

    def test_hold_prefers_one_rack_among_nodes_ready_as_early(self) -> None:
        """c1 drains first (t=50) but alone in its rack; the gang cannot start before t=100
        anyway, when both r2 nodes are free: it holds those two."""
        ends = {"c1": 50.0, "a1": 100.0, "b1": 100.0, "b2": 100.0}
        racks = {"c1": "r3", "a1": "r1", "b1": "r2", "b2": "r2"}
        s = snap(
            [rack(n, 0, racks[n]) for n in ends],
            [gang("big", 16, team="b")],
            running=[run(f"x-{n}", n, team="a", gpus=8, expected_s=e) for n, e in ends.items()],
            teams=[team("a"), team("b")],
            now=10,
        )
        holds = [d for d in schedule(s).decisions if isinstance(d, HoldForBackfill)]
        assert [(h.node_id, h.start_at_s) for h in holds] == [("b1", 100.0), ("b2", 100.0)]

    def test_hold_is_kept_and_renewed_on_the_same_nodes(self) -> None:
        prev = (
            BackfillReservation("big", "n1", 8, 250.0),
            BackfillReservation("big", "n2", 8, 250.0),
        )
        result = schedule(drain_snapshot(prev))  # type: ignore[arg-type]
        holds = [d for d in result.decisions if isinstance(d, HoldForBackfill)]
        holds = [h for h in holds if h.job_id == "big"]
        assert [(h.node_id, h.start_at_s) for h in holds] == [("n1", 200.0), ("n2", 200.0)]

    def test_hold_moves_to_nodes_ready_earlier_never_later(self) -> None:
        """Held on n3/n4 (ready at 400) while n1/n2 are now expected at 200 (the work on the
        held nodes ran later than estimated): the hold moves earlier."""
        prev = (
            BackfillReservation("big", "n3", 8, 300.0),
            BackfillReservation("big", "n4", 8, 400.0),
        )
        result = schedule(drain_snapshot(prev))  # type: ignore[arg-type]
        holds = [d for d in result.decisions if isinstance(d, HoldForBackfill)]
        holds = [h for h in holds if h.job_id == "big"]
        assert [(h.node_id, h.start_at_s) for h in holds] == [("n1", 200.0), ("n2", 200.0)]

    def test_gang_starts_once_its_nodes_drained(self) -> None:
        s = snap(
            [node("n1", 8), node("n2", 8), node("n3", 1)],
            [gang("big", 16, team="b"), gang("s", 1, team="a", at=1)],
            running=[run("r3", "n3", team="a", gpus=7, expected_s=500)],
            teams=[team("a"), team("b")],
            now=300,
        )
        prev = (
            BackfillReservation("big", "n1", 8, 200.0),
            BackfillReservation("big", "n2", 8, 200.0),
        )
        result = schedule(replace(s, reservations=prev))
        assert sorted(member_nodes(result, "big")) == ["n1", "n2"]
        assert [d.node_id for d in result.decisions if isinstance(d, Place)] == ["n3"]


def test_single_node_jobs_unchanged_by_gang_fields() -> None:
    """``nodes=1`` or ``gpus_per_node == gpu_count`` is a plain single-node job."""
    nodes = [node("n1", 8), node("n2", 4)]
    for res in (Resources(4, nodes=1), Resources(4, gpus_per_node=4)):
        pj = replace(gang("j", 4), resources=res)
        result = schedule(snap(nodes, [pj]), PolicyConfig())
        assert [type(d).__name__ for d in result.decisions] == ["Place"]
        assert result.decisions[0].node_id == "n2"  # type: ignore[union-attr]


@st.composite
def gang_snapshots(draw: st.DrawFn) -> CycleResult:
    nodes, running = [], []
    for i in range(draw(st.integers(2, 8))):
        total = draw(st.sampled_from([4, 8]))
        free = draw(st.integers(0, total))
        gpu_type = draw(st.sampled_from(["A100", "H100"]))
        r = draw(st.sampled_from(["r1", "r2", "r3"]))
        nodes.append(node(f"n{i}", free, total=total, gpu_type=gpu_type, labels={"rack": r}))
        if free < total:
            running.append(
                run(
                    f"x{i}",
                    f"n{i}",
                    team=draw(st.sampled_from(["a", "b"])),
                    gpus=total - free,
                    priority=draw(st.sampled_from([P.LOW, P.NORMAL])),
                    expected_s=draw(st.sampled_from([None, 50.0, 500.0])),
                    gpu_type=gpu_type,
                )
            )
    pending = [
        gang(
            f"j{k}",
            draw(st.sampled_from([1, 4, 8, 12, 16, 24])),
            team=draw(st.sampled_from(["a", "b"])),
            partial=draw(st.booleans()),
            priority=draw(st.sampled_from([P.NORMAL, P.HIGH])),
            at=float(k),
        )
        for k in range(draw(st.integers(1, 6)))
    ]
    s = snap(nodes, pending, running, [team("a", guarantee=8), team("b")], now=10.0)
    return s, schedule(s)  # type: ignore[return-value]


@settings(max_examples=150, deadline=None)
@given(gang_snapshots())
def test_any_pass_places_gangs_whole_and_within_free(case: object) -> None:
    s, result = case  # type: ignore[misc]
    nodes = {n.node_id: n for n in s.nodes}
    jobs = {j.job_id: j for j in s.pending}
    used: dict[str, int] = {}
    for d in result.decisions:
        if isinstance(d, Place):
            used[d.node_id] = used.get(d.node_id, 0) + d.gpu_count
        elif isinstance(d, PlaceGang):
            res = jobs[d.job_id].resources
            ids = [m.node_id for m in d.members]
            assert len(set(ids)) == len(ids) > 1
            assert len({nodes[i].gpu_type for i in ids}) == 1
            assert sum(m.gpu_count for m in d.members) == res.gpu_count
            size = max(n.total_gpus for n in s.nodes if n.gpu_type == nodes[ids[0]].gpu_type)
            assert tuple(m.gpu_count for m in d.members) == gang_members(res, size)
            assert [m.rank for m in d.members] == list(range(len(ids)))
            for m in d.members:
                used[m.node_id] = used.get(m.node_id, 0) + m.gpu_count
        elif isinstance(d, Preempt):
            assert d.victim_run_ids
    for nid, n in used.items():
        assert n <= nodes[nid].free_gpus


def test_gang_without_reservation_because_running_work_is_unbounded_says_so() -> None:
    running = [run(f"r{i}", f"n{i}", team="a", gpus=7) for i in range(1, 3)]  # no bound
    s = snap(
        [node(f"n{i}", 1) for i in range(1, 3)],
        [gang("big", 16, team="b", at=0)],
        running=running,
        teams=[team("a"), team("b")],
        now=10,
    )
    result = schedule(s)  # type: ignore[arg-type]
    assert not [d for d in result.decisions if isinstance(d, HoldForBackfill)]
    why = result.waiting["big"]
    assert why.code == "no_node_fits_now" and why.details.get("gang")
    assert "no max_runtime_s" in why.message
    assert why.details["no_reservation"] == "running_work_unbounded"


@st.composite
def one_domain_gang_cases(draw: st.DrawFn) -> tuple[object, ...]:
    """An unlabeled fleet (one topology domain) with free GPUs, other jobs' shadows and this
    job's holds, and a gang's members (largest first)."""
    n = draw(st.integers(2, 12))
    nodes = [node(f"n{i}", draw(st.integers(0, 8))) for i in range(n)]
    holds = [
        GpuHold("g", f"n{i}", draw(st.integers(1, 8)), 0.0)
        for i in range(n)
        if nodes[i].free_gpus and draw(st.booleans()) and draw(st.booleans())
    ]
    index = FreeIndex(nodes, holds)
    for i in range(n):
        if draw(st.booleans()):
            index.add_shadow(
                f"n{i}",
                Shadow(draw(st.sampled_from(["other", "g"])), 50.0, 4, draw(st.integers(0, 8))),
            )
    members = tuple(
        sorted(draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=2, max_size=5)), reverse=True)
    )
    hard_end = draw(st.sampled_from([None, 10.0, 100.0]))
    return index, members, hard_end, [h.node_id for h in holds]


@settings(max_examples=300, deadline=None)
@given(one_domain_gang_cases())
def test_one_domain_gang_fit_matches_the_topology_walk(case: tuple[object, ...]) -> None:
    """The one-domain shortcut of ``find_gang`` (acceptability asked lazily) picks the same
    nodes as the general walk over racks and switches does on the same candidates."""
    index, members, hard_end, held = case
    assert isinstance(index, FreeIndex) and isinstance(members, tuple)
    assert isinstance(held, list) and (hard_end is None or isinstance(hard_end, float))
    res = Resources(sum(members), nodes=len(members), allow_partial_nodes=True)
    got = find_gang(index, res, {}, "A100", members, hard_end, "g", held)
    cands = index.gang_candidates("A100", {}, members[-1], "g", held)
    want = (
        None
        if len(cands) < len(members)
        else _topology_fit(index, res, cands, members, hard_end, "g", held)
    )
    assert got == want
    if got is not None:
        assert len(set(got)) == len(members)
