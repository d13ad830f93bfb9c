"""Ordering rules for large jobs (policy.ordering, issue 29): SRPT shift in a team's queue,
reservations for the first K blocked large jobs, and the per-job displacement cap."""

from __future__ import annotations

from dataclasses import replace

from policy_builders import job, node, run, snap, team

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill, Place, Preempt
from gpufleet.policy.ordering import LARGE_RESERVATION, capped_jobs, srpt_queue_key
from gpufleet.policy.priority import queue_key
from gpufleet.policy.snapshot import Displacement

HOUR = 3600.0
OFF = PolicyConfig(headroom_wait_s=None, defrag_wait_s=None)


def places(result: object) -> dict[str, str]:
    return {d.job_id: d.node_id for d in result.decisions if isinstance(d, Place)}  # type: ignore[attr-defined]


class TestSrpt:
    def one_slot(self) -> object:
        """One free GPU; "long" (predicted 10 h) queued 10 min before "short" (5 min)."""
        return snap(
            [node("n1", 1)],
            [
                replace(job("long", at=0.0), predicted_duration_s=10 * HOUR),
                replace(job("short", at=600.0), predicted_duration_s=300.0),
            ],
            now=900.0,
        )

    def test_off_serves_queue_time(self) -> None:
        assert places(schedule(self.one_slot(), OFF)) == {"long": "n1"}

    def test_on_serves_the_shorter_prediction_first_and_says_why(self) -> None:
        cfg = replace(OFF, srpt_weight=1.0, srpt_cap_s=4 * HOUR)
        r = schedule(self.one_slot(), cfg)
        assert places(r) == {"short": "n1"}
        why = r.waiting["long"]
        assert why.details["srpt_shift_s"] == 4 * HOUR  # capped
        assert "shorter predicted work first" in why.message

    def test_the_cap_bounds_how_far_a_job_is_passed(self) -> None:
        cfg = replace(OFF, srpt_weight=1.0, srpt_cap_s=4 * HOUR)
        key = srpt_queue_key(cfg)
        old = replace(job("old", at=0.0), predicted_duration_s=100 * HOUR)
        later = replace(job("later", at=4 * HOUR + 1.0), predicted_duration_s=1.0)
        assert key(old) < key(later)  # queued more than the cap later: never passes
        assert queue_key(cfg) is not None and queue_key(OFF)(old) < queue_key(OFF)(later)

    def test_the_user_estimate_comes_before_the_prediction(self) -> None:
        cfg = replace(OFF, srpt_weight=1.0)
        key = srpt_queue_key(cfg)
        a = replace(job("a", at=0.0, expected_s=60.0), predicted_duration_s=10 * HOUR)
        b = replace(job("b", at=30.0), predicted_duration_s=600.0)
        assert key(a) < key(b)


class TestLargeReservations:
    def full(self) -> object:
        """Four full nodes whose work ends at 1, 2, 3 and 4 h; team a queues a 1-GPU head and
        three 8-GPU jobs, team b nothing."""
        return snap(
            [node(f"n{i}", 0) for i in range(1, 5)],
            [job("small", gpus=1, at=0.0)]
            + [job(f"big{i}", gpus=8, at=10.0 + i) for i in range(3)],
            [run(f"r{i}", f"n{i}", gpus=8, expected_s=i * HOUR) for i in range(1, 5)],
            [team("a", guarantee=32)],
            now=60.0,
        )

    def reserved(self, r: object) -> set[str]:
        return {d.job_id for d in r.decisions if isinstance(d, HoldForBackfill)}  # type: ignore[attr-defined]

    def test_off_one_reservation_per_size(self) -> None:
        assert self.reserved(schedule(self.full(), OFF)) == {"small", "big0"}

    def test_on_the_first_k_blocked_large_jobs_get_one_each(self) -> None:
        r = schedule(self.full(), replace(OFF, large_reservations=2))
        assert self.reserved(r) == {"small", "big0", "big1", "big2"}
        assert r.waiting["big1"].details["ordering"] == LARGE_RESERVATION
        assert r.waiting["big2"].details["ordering"] == LARGE_RESERVATION
        assert "ordering" not in r.waiting["big0"].details  # the size's own reservation

    def test_k_bounds_them(self) -> None:
        r = schedule(self.full(), replace(OFF, large_reservations=1))
        assert self.reserved(r) == {"small", "big0", "big1"}
        assert r.waiting["big2"].code != "waiting_with_reservation"


class TestDisplacementCap:
    def borrowed(self, displaced: int) -> object:
        """a borrows n1 with one 8-GPU job; b (guarantee 8) wants it back."""
        s = snap(
            [node("n1", 0)],
            [job("b1", team="b", gpus=8, at=50.0)],
            [run("a1", "n1", team="a", gpus=8, started=10.0)],
            [team("a", guarantee=0), team("b", guarantee=8)],
            now=100.0,
        )
        ds = tuple(
            Displacement("j-a1", 100.0 - 60.0 * k, 1.0, "reclaim") for k in range(displaced)
        )
        return replace(s, recent_displacements=ds)  # type: ignore[arg-type]

    def test_below_the_cap_it_is_reclaimed(self) -> None:
        cfg = replace(OFF, max_preemptions_per_job=3)
        r = schedule(self.borrowed(2), cfg)
        assert [d.for_job_id for d in r.decisions if isinstance(d, Preempt)] == ["b1"]

    def test_at_the_cap_it_is_not_a_victim(self) -> None:
        cfg = replace(OFF, max_preemptions_per_job=3)
        r = schedule(self.borrowed(3), cfg)
        assert not [d for d in r.decisions if isinstance(d, Preempt)]
        assert schedule(self.borrowed(3), OFF).decisions  # no cap: reclaimed

    def test_the_window_forgets(self) -> None:
        cfg = replace(OFF, max_preemptions_per_job=1, preemption_window_s=30.0)
        ds = (Displacement("x", 0.0, 1.0, "reclaim"), Displacement("y", 90.0, 1.0, "priority"))
        assert capped_jobs(ds, 100.0, cfg) == frozenset({"y"})
        assert capped_jobs(ds, 100.0, OFF) == frozenset()
        assert capped_jobs(None, 100.0, cfg) == frozenset()
