"""Headroom and defragmentation for large jobs (policy.defrag, seed DD7)."""

from __future__ import annotations

import random
from dataclasses import replace

from policy_builders import job, node, run, team
from policy_builders import snap as _snap

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import _Pass, schedule
from gpufleet.policy.decisions import HoldForBackfill, Place, Preempt
from gpufleet.policy.headroom import _drain_key, _Drains
from gpufleet.policy.snapshot import BackfillReservation, ClusterSnapshot, Displacement

HOUR = 3600.0
# Defragmentation on after 2 h, a budget large enough not to matter unless a test says so.
CFG = PolicyConfig(headroom_wait_s=1800.0, defrag_wait_s=2 * HOUR, displacement_budget_share=100.0)


def places(result: object) -> dict[str, str]:
    return {d.job_id: d.node_id for d in result.decisions if isinstance(d, Place)}  # type: ignore[attr-defined]


def preempts(result: object) -> list[Preempt]:
    return [d for d in result.decisions if isinstance(d, Preempt)]  # type: ignore[attr-defined]


def snap(*args: object, **kw: object) -> ClusterSnapshot:
    """The builders' snapshot with an (empty) displacement history: the driver tracks it."""
    return replace(_snap(*args, **kw), recent_displacements=())  # type: ignore[arg-type]


def fragmented(now: float, **kw: object) -> ClusterSnapshot:
    """Two 8-GPU nodes: n1 has 7 GPUs in use (1 free), n2 has 4 in use (4 free). A big
    8-GPU job waits since t=0; a 3-GPU job arrives later (best fit: only n2 holds it)."""
    return snap(
        [node("n1", 1), node("n2", 4)],
        [job("big", gpus=8, at=0.0), job("mid", gpus=3, at=now - 60.0)],
        [
            run("r1", "n1", gpus=3),
            run("r2", "n1", gpus=2),
            run("r3", "n1", gpus=2),
            run("r4", "n2", gpus=2),
            run("r5", "n2", gpus=2),
        ],
        now=now,
        **kw,  # type: ignore[arg-type]
    )


class TestHeadroom:
    def test_shields_the_node_that_drains_soonest_from_small_jobs(self) -> None:
        r = schedule(fragmented(now=HOUR), replace(CFG, defrag_wait_s=None))
        assert "mid" not in places(r)  # n2 is kept for the big job
        why = r.waiting["big"]
        assert why.code == "waiting_with_headroom"
        assert why.details["nodes"] == ["n2"]
        assert r.waiting["mid"].code == "blocked_by_reservation"
        assert r.waiting["mid"].details["held_for_job"] == "big"

    def test_before_the_threshold_small_jobs_fill_the_node(self) -> None:
        r = schedule(fragmented(now=600.0), CFG)
        assert places(r) == {"mid": "n2"}
        assert r.waiting["big"].code != "waiting_with_headroom"

    def test_switched_off_small_jobs_fill_the_node(self) -> None:
        cfg = replace(CFG, headroom_wait_s=None, defrag_wait_s=None)
        r = schedule(fragmented(now=HOUR), cfg)
        assert places(r) == {"mid": "n2"}

    def test_known_ends_pick_the_earliest_drain_not_the_emptiest(self) -> None:
        """n1 has more GPUs in use but its work ends in 10 min; n2's never ends."""
        s = snap(
            [node("n1", 1), node("n2", 4)],
            [job("big", gpus=8), job("mid", gpus=1, at=HOUR - 60.0)],
            [
                run("r1", "n1", gpus=7, started=0.0, max_runtime_s=HOUR + 600.0),
                run("r4", "n2", gpus=4),
            ],
            now=HOUR,
        )
        r = schedule(s, replace(CFG, defrag_wait_s=None))
        assert r.waiting["big"].details["nodes"] == ["n1"]
        assert r.waiting["big"].estimated_start_s == HOUR + 600.0
        assert places(r) == {"mid": "n2"}  # best fit would have taken n1's free GPU

    def test_a_job_that_fits_now_is_placed_and_its_shield_released(self) -> None:
        s = snap(
            [node("n1", 8), node("n2", 8)],
            [job("big", gpus=8), *(job(f"s{i}", gpus=1, at=HOUR - 1.0) for i in range(4))],
            now=HOUR,
        )
        r = schedule(s, CFG)
        p = places(r)
        assert set(p) == {"big", "s0", "s1", "s2", "s3"}
        assert {p[f"s{i}"] for i in range(4)} == {"n2" if p["big"] == "n1" else "n1"}

    def test_at_most_the_configured_share_of_nodes_is_shielded(self) -> None:
        nodes = [node(f"n{i}", 4) for i in range(10)]
        running = [run(f"r{i}", f"n{i}", gpus=4) for i in range(10)]
        pending = [job(f"big{i}", gpus=8, at=float(i)) for i in range(5)]
        pending.append(job("s", gpus=4, at=HOUR - 1.0))
        r = schedule(snap(nodes, pending, running, now=HOUR), replace(CFG, defrag_wait_s=None))
        shielded = [j for j in r.waiting if r.waiting[j].code == "waiting_with_headroom"]
        assert shielded == ["big0"]  # 10% of 10 nodes: the longest-waiting job only
        assert "s" in places(r)


def two_draining(now: float, n1_end: float, n2_end: float) -> ClusterSnapshot:
    """n1 and n2 each run 4 GPUs of work ending at the given times; a big 8-GPU job waits
    since t=0 (so it has headroom)."""
    return snap(
        [node("n1", 4), node("n2", 4)],
        [job("big", gpus=8, at=0.0)],
        [
            run("r1", "n1", gpus=4, started=0.0, max_runtime_s=n1_end),
            run("r2", "n2", gpus=4, started=0.0, max_runtime_s=n2_end),
        ],
        now=now,
    )


class TestStickyShields:
    """A shield persists across passes like a reservation (``CycleResult.shields`` fed back
    as ``ClusterSnapshot.reservations``): it stays on its node when another is only a little
    earlier, and moves when one is ready much earlier."""

    cfg = replace(CFG, defrag_wait_s=None)

    def test_a_shield_stays_on_its_node_when_nothing_much_earlier_appears(self) -> None:
        r1 = schedule(two_draining(HOUR, HOUR + 1000.0, HOUR + 2000.0), self.cfg)
        assert r1.waiting["big"].details["nodes"] == ["n1"]
        assert r1.shields == (BackfillReservation("big", "n1", 8, HOUR + 1000.0, True),)
        # next pass: n1's work ran late, n2 is now expected to drain a little sooner
        now = HOUR + 600.0
        later = two_draining(now, now + 1500.0, now + 1200.0)
        fresh = schedule(later, self.cfg)
        assert fresh.waiting["big"].details["nodes"] == ["n2"]  # without the previous shield
        kept = schedule(replace(later, reservations=r1.shields), self.cfg)
        assert kept.waiting["big"].details["nodes"] == ["n1"]
        assert kept.waiting["big"].estimated_start_s == now + 1500.0
        assert kept.shields == (BackfillReservation("big", "n1", 8, now + 1500.0, True),)
        assert not any(isinstance(d, HoldForBackfill) for d in kept.decisions)

    def test_a_shield_moves_when_another_node_is_ready_much_earlier(self) -> None:
        r1 = schedule(two_draining(HOUR, HOUR + 1000.0, HOUR + 2000.0), self.cfg)
        now = HOUR + 600.0
        much_earlier = two_draining(now, now + 1500.0, now + 100.0)
        r2 = schedule(replace(much_earlier, reservations=r1.shields), self.cfg)
        assert r2.waiting["big"].details["nodes"] == ["n2"]
        assert r2.shields == (BackfillReservation("big", "n2", 8, now + 100.0, True),)

    def test_a_shield_leaves_a_node_that_became_unschedulable(self) -> None:
        r1 = schedule(two_draining(HOUR, HOUR + 1000.0, HOUR + 2000.0), self.cfg)
        s = two_draining(HOUR + 600.0, HOUR + 1000.0, HOUR + 2000.0)
        s = replace(s, nodes=(replace(s.nodes[0], schedulable=False), s.nodes[1]))
        r2 = schedule(replace(s, reservations=r1.shields), self.cfg)
        assert r2.waiting["big"].details["nodes"] == ["n2"]

    def test_a_placed_job_leaves_no_shield(self) -> None:
        r1 = schedule(two_draining(HOUR, HOUR + 1000.0, HOUR + 2000.0), self.cfg)
        s = snap([node("n1", 8), node("n2", 4)], [job("big", gpus=8)], now=HOUR + 1100.0)
        r2 = schedule(replace(s, reservations=r1.shields), self.cfg)
        assert places(r2) == {"big": "n1"}
        assert r2.shields == ()


class TestDefragment:
    def test_picks_the_min_cost_set_that_frees_a_whole_node(self) -> None:
        """n1: 1-GPU jobs checkpointed a minute ago (little work lost); n2: 1-GPU jobs
        running an hour without a checkpoint. n3: one 4-GPU job (large, never a victim)."""
        now = 3 * HOUR
        s = snap(
            [node("n1", 4), node("n2", 4), node("n3", 4)],
            [job("big", gpus=8)],
            [run(f"a{i}", "n1", started=0.0, checkpoint=now - 60.0) for i in range(4)]
            + [run(f"b{i}", "n2", started=now - HOUR) for i in range(4)]
            + [run("c", "n3", gpus=4, started=now - 60.0)],
            now=now,
        )
        r = schedule(s, CFG)
        (pre,) = preempts(r)
        assert pre.reason == "defragment" and pre.node_id == "n1"
        assert pre.victim_run_ids == ("a0", "a1", "a2", "a3")
        assert pre.gpu_count == 8
        why = r.waiting["big"]
        assert why.code == "waiting_for_preemption" and why.details["ground"] == "defragment"

    def test_frees_only_what_is_needed_cheapest_first(self) -> None:
        """A 6-GPU job on a node with 2 free: of 1-, 2- and 3-GPU victims the cheapest set
        reaching 4 GPUs by lost work is 1 + 3 (the 2-GPU job ran longest)."""
        now = 3 * HOUR
        s = snap(
            [node("n1", 2)],
            [job("big", gpus=6)],
            [
                run("x1", "n1", gpus=1, started=now - 600.0),
                run("x2", "n1", gpus=2, started=0.0),
                run("x3", "n1", gpus=3, started=now - 600.0),
            ],
            now=now,
        )
        r = schedule(s, replace(CFG, large_job_node_share=0.75))
        (pre,) = preempts(r)
        assert pre.victim_run_ids == ("x1", "x3")

    def test_prefers_lower_priority_victims(self) -> None:
        now = 3 * HOUR
        s = snap(
            [node("n1", 4), node("n2", 4)],
            [job("big", gpus=8, priority=P.HIGH)],
            [run(f"a{i}", "n1", priority=P.NORMAL, started=now - 60.0) for i in range(4)]
            + [run(f"b{i}", "n2", priority=P.LOW, started=now - HOUR) for i in range(4)],
            now=now,
        )
        (pre,) = preempts(schedule(s, CFG))
        assert pre.node_id == "n2"

    def test_never_preempts_non_preemptible_or_higher_priority_jobs(self) -> None:
        now = 3 * HOUR
        s = snap(
            [node("n1", 4), node("n2", 4)],
            [job("big", gpus=8)],
            [run("keep", "n1", preemptible=False)]
            + [run(f"a{i}", "n1") for i in range(3)]
            + [run("vip", "n2", priority=P.CRITICAL)]
            + [run(f"b{i}", "n2") for i in range(3)],
            now=now,
        )
        r = schedule(s, CFG)
        assert not preempts(r)
        assert r.waiting["big"].code == "waiting_with_headroom"

    def test_waits_for_a_drain_that_is_coming(self) -> None:
        now = 3 * HOUR
        s = snap(
            [node("n1", 4)],
            [job("big", gpus=8)],
            [run(f"a{i}", "n1", max_runtime_s=now + 600.0) for i in range(4)],
            now=now,
        )
        r = schedule(s, CFG)
        assert not preempts(r)
        assert r.waiting["big"].code == "waiting_with_headroom"

    def test_budget_is_respected(self) -> None:
        """Budget 0.02 x 16 GPUs = 0.32 GPU-h per hour. Four 1-GPU victims that ran 3 min
        each lose 0.2 GPU-h: allowed on an empty budget, refused after 0.2 GPU-h of
        defragmentation in the last hour, allowed again when that is over an hour old."""
        now = 3 * HOUR
        base = snap(
            [node("n1", 4), node("n2", 0)],
            [job("big", gpus=8)],
            [run(f"a{i}", "n1", started=now - 180.0) for i in range(4)]
            + [run("whole", "n2", gpus=8, preemptible=False)],
            now=now,
        )
        cfg = replace(CFG, displacement_budget_share=0.02)
        assert len(preempts(schedule(base, cfg))) == 1
        spent = (Displacement("old", now - 600.0, 0.2, "defragment"),)
        assert not preempts(schedule(replace(base, recent_displacements=spent), cfg))
        # other reasons do not count against the budget; displacements over an hour old
        # neither
        other = (
            Displacement("old", now - 600.0, 5.0, "reclaim"),
            Displacement("old2", now - HOUR - 1.0, 5.0, "defragment"),
        )
        assert len(preempts(schedule(replace(base, recent_displacements=other), cfg))) == 1

    def test_a_job_displaced_recently_is_not_displaced_again(self) -> None:
        now = 3 * HOUR
        s = snap(
            [node("n1", 4), node("n2", 4)],
            [job("big", gpus=8)],
            [run(f"a{i}", "n1", started=now - 60.0) for i in range(4)]
            + [run(f"b{i}", "n2", started=now - HOUR) for i in range(4)],
            now=now,
        )
        (pre,) = preempts(schedule(s, CFG))
        assert pre.node_id == "n1"
        recent = (Displacement("j-a2", now - HOUR, 0.0, "defragment"),)
        (pre,) = preempts(schedule(replace(s, recent_displacements=recent), CFG))
        assert pre.node_id == "n2"  # a2 is protected by the anti-thrash window
        old = (Displacement("j-a2", now - CFG.anti_thrash_s - 1.0, 0.0, "defragment"),)
        (pre,) = preempts(schedule(replace(s, recent_displacements=old), CFG))
        assert pre.node_id == "n1"

    def test_other_teams_guarantees_are_not_taken_for_a_borrowing_team(self) -> None:
        """Seed DD4: team a is above its guarantee; b runs inside its own. a's big job may
        not displace b's jobs; once a's job fits in a's guarantee, it may."""
        now = 3 * HOUR
        s = snap(
            [node("n1", 4)],
            [job("big", team="a", gpus=8)],
            [run(f"b{i}", "n1", team="b") for i in range(4)],
            teams=[team("a", guarantee=0), team("b", guarantee=8)],
            now=now,
        )
        assert not preempts(schedule(s, CFG))
        s2 = replace(s, teams={"a": team("a", guarantee=8), "b": team("b", guarantee=4)})
        (pre,) = preempts(schedule(s2, CFG))
        assert pre.reason == "defragment"

    def test_other_teams_jobs_may_move_when_they_restart_at_once_elsewhere(self) -> None:
        """Team a is above its guarantee; b's four 1-GPU jobs on n1 are within b's own.
        Free GPUs are scattered: 4 on n1, 4 on n2, so no node holds a's 8-GPU job. Taking
        b's GPUs would break DD4, but moving its jobs does not: n2 holds them now, so they
        are displaced (a migration: b keeps its share) and n1 is freed for the big job."""
        now = 3 * HOUR
        s = snap(
            [node("n1", 4), node("n2", 4)],
            [job("big", team="a", gpus=8)],
            [run(f"b{i}", "n1", team="b", started=now - 600.0) for i in range(4)]
            + [run(f"c{i}", "n2", team="b", started=0.0) for i in range(4)],
            teams=[team("a", guarantee=0), team("b", guarantee=16)],
            now=now,
        )
        (pre,) = preempts(schedule(s, CFG))
        assert pre.reason == "defragment" and pre.node_id == "n1"
        assert pre.victim_run_ids == ("b0", "b1", "b2", "b3")
        assert not preempts(schedule(s, replace(CFG, defrag_migrate=False)))

    def test_no_migration_without_room_for_the_displaced_jobs(self) -> None:
        """As above, but n2 has only 3 free GPUs: one of b's jobs could not restart, so its
        GPUs would be taken, not moved; nothing is displaced."""
        now = 3 * HOUR
        s = snap(
            [node("n1", 4), node("n2", 3)],
            [job("big", team="a", gpus=8)],
            [run(f"b{i}", "n1", team="b", started=now - 600.0) for i in range(4)]
            + [run(f"c{i}", "n2", team="b", started=0.0) for i in range(5)],
            teams=[team("a", guarantee=0), team("b", guarantee=16)],
            now=now,
        )
        assert not preempts(schedule(s, CFG))

    def test_off_without_preemption(self) -> None:
        now = 3 * HOUR
        s = snap(
            [node("n1", 4)], [job("big", gpus=8)], [run(f"a{i}", "n1") for i in range(4)], now=now
        )
        assert not preempts(schedule(s, replace(CFG, preemption=False)))
        assert not preempts(schedule(s, replace(CFG, defrag_wait_s=None)))

    def test_off_when_the_driver_keeps_no_displacement_history(self) -> None:
        now = 3 * HOUR
        s = snap(
            [node("n1", 4)], [job("big", gpus=8)], [run(f"a{i}", "n1") for i in range(4)], now=now
        )
        assert len(preempts(schedule(s, CFG))) == 1
        r = schedule(replace(s, recent_displacements=None), CFG)
        assert not preempts(r)
        assert r.waiting["big"].code == "waiting_with_headroom"


class TestDrainRankings:
    """``_Drains`` makes the rankings of every size of a type in one walk (``_keys``): each
    must equal the per-node ``_drain_key`` of every schedulable node of the type, sorted,
    as of the moment the size is first asked for (a ranking made ahead of a hold is made
    again after it)."""

    @staticmethod
    def fleet(seed: int) -> ClusterSnapshot:
        rng = random.Random(seed)
        nodes, running = [], []
        for i in range(24):
            gpu_type = ("A100", "H100")[i % 2]
            total = rng.choice((4, 8))
            used = rng.randint(0, total)
            nodes.append(
                node(
                    f"n{i:02d}",
                    total - used,
                    total=total,
                    gpu_type=gpu_type,
                    schedulable=rng.random() > 0.1,
                )
            )
            left, k = used, 0
            while left:
                g = min(left, rng.choice((1, 2, 4)))
                ends = rng.choice((None, HOUR, 3 * HOUR, 0.5 * HOUR))
                running.append(
                    run(
                        f"r{i}-{k}",
                        f"n{i:02d}",
                        gpus=g,
                        gpu_type=gpu_type,
                        started=rng.uniform(0, HOUR),
                        expected_s=ends,
                    )
                )
                left -= g
                k += 1
        return snap(nodes, [job("big", gpus=8, at=0.0)], running, now=2 * HOUR)

    def expected(self, p: object, big: object, gpu_type: str, need: int) -> list[object]:
        return sorted(
            _drain_key(p, big, nid, need)  # type: ignore[arg-type]
            for nid, n in p.index.nodes.items()  # type: ignore[attr-defined]
            if n.gpu_type == gpu_type and n.schedulable and n.total_gpus >= need
        )

    def test_every_size_equals_the_per_node_keys_also_after_a_hold(self) -> None:
        for seed in range(20):
            s = self.fleet(seed)
            p = _Pass(s, CFG)
            big = s.pending[0]
            drains = _Drains(p, set(), {"A100": {2, 4, 8}, "H100": {2, 4, 8}})
            assert drains.ranked(big, "A100", 4) == self.expected(p, big, "A100", 4)
            # a hold changes the free GPUs: sizes made ahead are made again when asked
            held = next(
                (
                    nid
                    for nid, n in p.index.nodes.items()
                    if n.gpu_type == "A100" and n.schedulable and n.free_gpus > 0
                ),
                None,
            )
            if held is not None:
                p.index.hold(held, "someone-else", 8)
                drains.held()
            for need in (2, 8):
                assert drains.ranked(big, "A100", need) == self.expected(p, big, "A100", need)
            for need in (8, 2, 4):
                assert drains.ranked(big, "H100", need) == self.expected(p, big, "H100", need)
