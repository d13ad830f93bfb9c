"""Backfill reservations, reclaim and priority preemption, as policy decisions."""

from __future__ import annotations

from dataclasses import replace

import pytest
from policy_builders import job, node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import Backfill, PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill, Place, Preempt
from gpufleet.policy.snapshot import BackfillReservation, GpuHold


def kinds(result: object) -> list[tuple[str, str, str]]:
    return [
        (type(d).__name__, getattr(d, "job_id", getattr(d, "for_job_id", "")), d.node_id)
        for d in result.decisions
    ]  # type: ignore[attr-defined]


def backfill_snapshot(small_runtime_s: float | None) -> object:
    """n1: 4 GPUs busy until t=100, 4 free; n2: 2 free (busy with unbounded work).
    Team b's 8-GPU job is blocked; team a streams 1-GPU jobs."""
    return snap(
        nodes=[node("n1", free=4), node("n2", free=2)],
        running=[
            run("r1", "n1", team="a", gpus=4, expected_s=100),
            run("r2", "n2", team="a", gpus=6),
        ],
        pending=[
            job("big", team="b", gpus=8, at=0),
            *(
                job(f"s{i}", team="a", gpus=1, at=i, max_runtime_s=small_runtime_s)
                for i in range(5)
            ),
        ],
        teams=[team("a"), team("b")],
        now=10,
    )


class TestBackfill:
    def test_blocked_head_gets_a_reservation(self) -> None:
        result = schedule(backfill_snapshot(None))
        holds = [d for d in result.decisions if isinstance(d, HoldForBackfill)]
        assert holds == [HoldForBackfill("big", "n1", 8, 100.0)]
        why = result.waiting["big"]
        assert why.code == "waiting_with_reservation"
        assert why.estimated_start_s == 100.0

    @pytest.mark.parametrize(
        ("runtime_s", "want_on_n1"),
        [
            pytest.param(None, 0, id="unbounded small jobs may not use the held GPUs"),
            pytest.param(500.0, 0, id="bound ends after the reservation: not on n1"),
            pytest.param(50.0, 3, id="bound ends before the reservation: backfilled"),
        ],
    )
    def test_small_jobs_only_where_they_do_not_delay_it(
        self, runtime_s: float | None, want_on_n1: int
    ) -> None:
        result = schedule(backfill_snapshot(runtime_s))
        places = [d for d in result.decisions if isinstance(d, Place)]
        assert sum(1 for d in places if d.node_id == "n2") == 2
        assert sum(1 for d in places if d.node_id == "n1") == want_on_n1
        waiting = {k: result.waiting[k].code for k in result.waiting if k != "big"}
        assert set(waiting.values()) <= {"blocked_by_reservation", "no_node_fits_now"}

    def test_reservation_is_sticky_across_passes(self) -> None:
        """Team a (smaller share) is served before b's big job; once the big job holds a
        reservation, a's later jobs cannot take the reserved GPUs."""
        s = snap(
            nodes=[node("n0", free=0), node("n1", free=6)],
            running=[
                run("rb", "n0", team="b", gpus=8),
                run("r1", "n1", team="a", gpus=2, expected_s=100),
            ],
            pending=[job("big", team="b", gpus=8), job("s0", team="a", at=5)],
            teams=[team("a"), team("b")],
            now=20,
        )
        first = schedule(s)
        assert ("Place", "s0", "n1") in kinds(first)  # without a reservation, a fills in
        second = schedule(replace(s, reservations=(BackfillReservation("big", "n1", 8, 100.0),)))
        assert kinds(second) == [("HoldForBackfill", "big", "n1")]
        assert second.waiting["s0"].code == "blocked_by_reservation"
        assert second.waiting["s0"].details["held_for_job"] == "big"

    def test_off_blocks_and_greedy_skips(self) -> None:
        s = backfill_snapshot(None)
        off = schedule(s, PolicyConfig(backfill=Backfill.OFF))  # type: ignore[arg-type]
        assert off.decisions == ()
        assert off.waiting["s0"].code == "behind_blocked_job"
        greedy = schedule(s, PolicyConfig(backfill=Backfill.GREEDY))  # type: ignore[arg-type]
        assert len([d for d in greedy.decisions if isinstance(d, Place)]) == 5


class TestReclaim:
    @staticmethod
    def full_cluster() -> object:
        """b (guarantee 8) has nothing; a borrows the whole 16-GPU fleet."""
        return snap(
            nodes=[node("n1", free=0), node("n2", free=0)],
            running=[
                run("a-old", "n1", team="a", gpus=8, started=0),
                run("a-new1", "n2", team="a", gpus=4, started=50, priority=P.HIGH),
                run("a-new2", "n2", team="a", gpus=4, started=60, checkpoint=90),
            ],
            pending=[job("b1", team="b", gpus=8, at=95)],
            teams=[team("a", guarantee=8), team("b", guarantee=8)],
            now=100,
        )

    def test_borrowers_are_preempted_for_the_owner(self) -> None:
        result = schedule(self.full_cluster())
        (pre,) = result.decisions
        assert pre == Preempt("b1", "n2", ("a-new1", "a-new2"), "reclaim", 8)
        assert result.waiting["b1"].code == "waiting_for_preemption"

    def test_held_gpus_go_to_the_preemptor_only(self) -> None:
        s = snap(
            nodes=[node("n1", free=0), node("n2", free=8)],
            running=[run("a-old", "n1", team="a", gpus=8)],
            pending=[job("a2", team="a", gpus=1, at=0), job("b1", team="b", gpus=8, at=95)],
            teams=[team("a", guarantee=8), team("b", guarantee=8, usage=1e9)],
            holds=[GpuHold("b1", "n2", 8, since_s=100)],
            now=130,
        )
        result = schedule(s)
        assert kinds(result)[0] == ("Place", "b1", "n2")
        assert "a2" in result.waiting

    def test_a_waiting_preemptors_quota_is_kept_from_jobs_it_precedes(self) -> None:
        """Team a (guarantee 24, may borrow 8) runs "mid" (8 GPUs). Its HIGH 24-GPU gang
        holds n1, freed by a stopped victim, and waits for a third node. A LOW 8-GPU job of
        the team fits the quota now (16 <= 32) but would leave the gang over it (40 > 32):
        it waits. Before, it started on n2, the gang preempted it once its hold timed out,
        and the two took each other's quota for ever (25 displacements of one job in
        tests/sim/data/priority_gangs.yaml)."""
        s = snap(
            nodes=[node("n1", 8), node("n2", 8), node("n3", 0), node("n4", 0)],
            running=[
                run("mid", "n3", team="a", gpus=8, priority=P.LOW),
                run("y1", "n4", team="b", gpus=8, preemptible=False),
            ],
            pending=[
                job("lo2", team="a", gpus=8, priority=P.LOW, at=0),
                job("hi", team="a", gpus=24, priority=P.HIGH, at=50),
            ],
            teams=[team("a", guarantee=24, borrow_limit=8), team("b", guarantee=8)],
            holds=[GpuHold("hi", "n1", 8, since_s=100, reason="priority")],
            now=130,
        )
        result = schedule(s)
        assert not any(k[0] == "Place" and k[1] == "lo2" for k in kinds(result))
        assert result.waiting["lo2"].code == "over_borrow_limit"

    def test_the_kept_quota_does_not_count_stopping_victims_twice(self) -> None:
        """Team a (guarantee 8, may borrow 4) still holds 8 GPUs in "v1", stopping for its
        HIGH job "hi", and 2 in "mid". A LOW 2-GPU job fits: 10 + 2 <= 12 now, and 2 + 2 + 8
        once v1 has stopped and hi runs. Counting hi's 8 on top of v1's (a new user's run)
        refused it for the whole grace period with GPUs free."""
        stopping = replace(
            run("v1", "n1", team="a", gpus=8, priority=P.LOW),
            stopping=True,
            stopping_for_job_id="hi",
        )
        s = snap(
            nodes=[node("n1", 0), node("n2", 8), node("n3", 6)],
            running=[stopping, run("mid", "n3", team="a", gpus=2, priority=P.LOW)],
            pending=[
                job("hi", team="a", gpus=8, priority=P.HIGH, at=50),
                job("lo2", team="a", gpus=2, priority=P.LOW, at=60),
            ],
            teams=[team("a", guarantee=8, borrow_limit=4)],
            holds=[GpuHold("hi", "n1", 8, since_s=100, reason="priority")],
            now=110,
        )
        result = schedule(s)
        assert any(k[0] == "Place" and k[1] == "lo2" for k in kinds(result))
        assert result.waiting["hi"].code == "waiting_for_preemption"

    def test_dead_hold_is_released(self) -> None:
        s = snap(
            nodes=[node("n2", free=8)],
            pending=[job("a2", team="a")],
            holds=[GpuHold("gone", "n2", 8, since_s=0)],
        )
        result = schedule(s)
        assert result.released_holds == ("gone",)
        assert kinds(result) == [("Place", "a2", "n2")]


class TestPriorityPreemption:
    @pytest.mark.parametrize(
        ("victim_priority", "preemptible", "want_preempt"),
        [
            pytest.param(P.LOW, True, True, id="strictly lower: preempted"),
            pytest.param(P.HIGH, True, False, id="equal priority: never"),
            pytest.param(P.LOW, False, False, id="not preemptible: never"),
        ],
    )
    def test_only_strictly_lower_priority_of_own_team(
        self, victim_priority: P, preemptible: bool, want_preempt: bool
    ) -> None:
        s = snap(
            nodes=[node("n1", free=2)],
            running=[
                run("v", "n1", team="a", gpus=6, priority=victim_priority, preemptible=preemptible)
            ],
            pending=[job("hi", team="a", gpus=8, priority=P.HIGH)],
            teams=[team("a", guarantee=8)],
        )
        result = schedule(s)
        pre = [d for d in result.decisions if isinstance(d, Preempt)]
        assert bool(pre) == want_preempt
        if want_preempt:
            assert pre[0].victim_run_ids == ("v",)
            assert pre[0].reason == "priority"

    def test_cheapest_victim_set(self) -> None:
        """Fewest GPU-seconds lost since checkpoint, then fewer victims."""
        s = snap(
            nodes=[node("n1", free=0)],
            running=[
                run("fresh-ckpt", "n1", team="a", gpus=4, priority=P.LOW, checkpoint=990),
                run("old-ckpt", "n1", team="a", gpus=4, priority=P.LOW, checkpoint=100),
            ],
            pending=[job("hi", team="a", gpus=4, priority=P.HIGH)],
            teams=[team("a", guarantee=8)],
            now=1000,
        )
        (pre,) = [d for d in schedule(s).decisions if isinstance(d, Preempt)]
        assert pre.victim_run_ids == ("fresh-ckpt",)

    @pytest.mark.parametrize(
        ("victim_queued_h", "want_preempt"),
        [
            pytest.param(-1.0, True, id="queued 1 h before the HIGH job: behind it, preempted"),
            pytest.param(-10.0, False, id="queued 10 h before: aged ahead of it, kept"),
            pytest.param(None, True, id="queue place unknown: by class alone"),
        ],
    )
    def test_never_a_job_the_queue_serves_first(
        self, victim_queued_h: float | None, want_preempt: bool
    ) -> None:
        """Aging gives a tier a head start (HIGH 8 h over LOW by default): a LOW job that
        queued 10 h before a HIGH one is ahead of it in the queue, so it may start first.
        Displacing it would requeue it ahead of the preemptor again (a preempted job keeps its
        place), and it would start and be displaced over and over: a user's scenario made
        1,131 preemptions that way, one HIGH gang waiting 57 days."""
        now = 100_000.0
        victim = run("v", "n1", team="a", gpus=6, priority=P.LOW)
        if victim_queued_h is not None:
            victim = replace(victim, queued_at_s=now + victim_queued_h * 3600.0)
        s = snap(
            nodes=[node("n1", free=2)],
            running=[victim],
            pending=[job("hi", team="a", gpus=8, priority=P.HIGH, at=now)],
            teams=[team("a", guarantee=8)],
            now=now,
        )
        pre = [d for d in schedule(s).decisions if isinstance(d, Preempt)]
        assert bool(pre) == want_preempt


class TestWhyWithoutRuntimeBounds:
    def test_reservation_message_is_relative_to_the_snapshot_clock(self) -> None:
        big = schedule(backfill_snapshot(None)).waiting["big"]
        # n1 frees at t=100 and the snapshot's now is t=10: 90 s from now, not an epoch
        assert "in 1m 30s" in big.message and "t=100" not in big.message
        assert big.details["reserved_from_s"] == 100.0

    def test_no_reservation_because_running_work_is_unbounded_says_so(self) -> None:
        s = snap(
            nodes=[node("n1", free=2)],
            running=[run("r1", "n1", team="a", gpus=6)],  # no max_runtime_s, no estimate
            pending=[job("big", team="b", gpus=8, at=0), job("s", team="a", gpus=1, at=1)],
            teams=[team("a"), team("b")],
            now=10,
        )
        result = schedule(s)
        assert not [d for d in result.decisions if isinstance(d, HoldForBackfill)]
        why = result.waiting["big"]
        assert why.code == "no_node_fits_now"
        assert "no max_runtime_s" in why.message and "may start first" in why.message
        assert why.details["no_reservation"] == "running_work_unbounded"
        # once the running work has a bound, the job gets its reservation instead
        bounded = replace(s, running=(run("r1", "n1", team="a", gpus=6, max_runtime_s=60),))
        assert schedule(bounded).waiting["big"].code == "waiting_with_reservation"
