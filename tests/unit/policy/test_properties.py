"""Properties of any pass over random snapshots (hypothesis)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from policy_builders import job, node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import Backfill, Ordering, Placement, PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill, Place, PlaceGang, Preempt
from gpufleet.policy.snapshot import ClusterSnapshot


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[ClusterSnapshot, PolicyConfig]:
    n_nodes = draw(st.integers(1, 6))
    nodes, running = [], []
    for i in range(n_nodes):
        total = draw(st.sampled_from([4, 8]))
        used = draw(st.integers(0, total))
        gpu_type = draw(st.sampled_from(["A100", "H100"]))
        nodes.append(
            node(
                f"n{i}",
                total - used,
                total=total,
                gpu_type=gpu_type,
                schedulable=draw(st.booleans()) or i == 0,
            )
        )
        left, k = used, 0
        while left > 0:
            g = min(left, draw(st.sampled_from([1, 2, 4])))
            running.append(
                run(
                    f"r{i}-{k}",
                    f"n{i}",
                    team=draw(st.sampled_from("abc")),
                    gpus=g,
                    priority=draw(st.sampled_from(list(P))),
                    gpu_type=gpu_type,
                    expected_s=draw(st.one_of(st.none(), st.floats(1, 1e4))),
                )
            )
            left -= g
            k += 1
    pending = [
        job(
            f"j{i:02d}",
            team=draw(st.sampled_from("abc")),
            gpus=draw(st.sampled_from([1, 2, 4, 8])),
            priority=draw(st.sampled_from(list(P))),
            at=draw(st.floats(0, 1e4)),
            types=draw(st.sampled_from([(), ("A100",), ("H100", "A100")])),
            max_runtime_s=draw(st.one_of(st.none(), st.floats(1, 1e4))),
        )
        for i in range(draw(st.integers(0, 25)))
    ]
    teams = [
        team(
            t,
            guarantee=draw(st.sampled_from([0, 4, 8])),
            borrow_limit=draw(st.one_of(st.none(), st.integers(0, 8))),
        )
        for t in "abc"
    ]
    cfg = PolicyConfig(
        ordering=draw(st.sampled_from(list(Ordering))),
        placement=draw(st.sampled_from(list(Placement))),
        backfill=draw(st.sampled_from(list(Backfill))),
        borrowing=draw(st.booleans()),
        preemption=draw(st.booleans()),
    )
    return snap(nodes, pending, running, teams, now=1e4), cfg


class TestEveryPass:
    @settings(max_examples=300, deadline=None)
    @given(snapshots())
    def test_safe_complete_and_deterministic(
        self, s: tuple[ClusterSnapshot, PolicyConfig]
    ) -> None:
        snapshot, cfg = s
        result = schedule(snapshot, cfg)
        nodes = {n.node_id: n for n in snapshot.nodes}
        places = [d for d in result.decisions if isinstance(d, Place)]
        gangs = [d for d in result.decisions if isinstance(d, PlaceGang)]
        # never more GPUs than free, never on an unschedulable node, never a job twice
        # (a job larger than a node is placed as a gang: every member counts)
        used: Counter[str] = Counter()
        for p in places:
            assert nodes[p.node_id].schedulable
            used[p.node_id] += p.gpu_count
        for g in gangs:
            for m in g.members:
                assert nodes[m.node_id].schedulable
                used[m.node_id] += m.gpu_count
        assert all(used[n] <= nodes[n].free_gpus for n in used)
        ids = [p.job_id for p in places] + [g.job_id for g in gangs]
        assert len(set(ids)) == len(ids)
        # each pending job is placed or has a reason, never both
        placed = set(ids)
        assert set(result.waiting) == {j.job_id for j in snapshot.pending} - placed
        for jid in result.waiting:
            why = result.waiting[jid]
            assert why.code and why.message and why.position and why.position >= 1
        # victims: strictly lower priority of the same team, or another team's loan
        runs = {r.run_id: r for r in snapshot.running}
        jobs = {j.job_id: j for j in snapshot.pending}
        for d in result.decisions:
            if isinstance(d, Preempt):
                pre = jobs[d.for_job_id]
                for v in d.victim_run_ids:
                    victim = runs[v]
                    assert victim.node_id == d.node_id
                    if d.reason == "priority":
                        assert victim.team_id == pre.team_id
                        assert victim.priority.rank < pre.priority.rank
                    else:
                        assert victim.team_id != pre.team_id
            if isinstance(d, HoldForBackfill):
                assert d.start_at_s >= snapshot.now_s
        # borrowing off: no placement takes a team above its guarantee
        if not cfg.borrowing:
            alloc: Counter[tuple[str, str]] = Counter()
            for r in snapshot.running:
                alloc[(r.team_id, r.gpu_type)] += r.gpu_count
            before = Counter(alloc)
            for p in places:
                alloc[(jobs[p.job_id].team_id, nodes[p.node_id].gpu_type)] += p.gpu_count
            for (tid, gpu_type), n in alloc.items():
                guarantee = snapshot.teams[tid].guaranteed_gpus.get(gpu_type, 0)
                assert n <= max(guarantee, before[(tid, gpu_type)])
        # same snapshot, same decisions
        assert schedule(snapshot, cfg).decisions == result.decisions
