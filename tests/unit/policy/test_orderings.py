"""The literature's shortest-first baselines: QSSF (predicted service) and SRTF (remaining
time, preemptive within a team), and SJF = SRTF with preemption off."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from policy_builders import job, node, run, snap, team

from gpufleet.policy.config import Backfill, Ordering, PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place, Preempt
from gpufleet.policy.priority import (
    predicted_service_gpu_s,
    queue_key,
    remaining_s,
    sorted_queues,
    srtf_remaining_s,
)

QSSF = PolicyConfig(ordering=Ordering.QSSF, backfill=Backfill.OFF, preemption=False)
SRTF = PolicyConfig(ordering=Ordering.SRTF, backfill=Backfill.GREEDY, preemption=True)
SJF = replace(SRTF, backfill=Backfill.OFF, preemption=False)


def order(cfg: PolicyConfig, *jobs: object) -> list[str]:
    return [j.job_id for j in sorted_queues(list(jobs), cfg)["a"]]  # type: ignore[arg-type]


class TestQueueKeys:
    def test_qssf_orders_by_gpus_times_prediction(self) -> None:
        # service: big 4 x 100 = 400; long 1 x 1000 = 1000; small 1 x 100 = 100
        big = replace(job("big", gpus=4, at=0.0), predicted_duration_s=100.0)
        long = replace(job("long", gpus=1, at=1.0), predicted_duration_s=1000.0)
        small = replace(job("small", gpus=1, at=2.0), predicted_duration_s=100.0)
        assert order(QSSF, big, long, small) == ["small", "big", "long"]
        assert predicted_service_gpu_s(big) == 400.0

    def test_qssf_prefers_prediction_then_user_estimate_unknown_last(self) -> None:
        # the platform's prediction wins over the user's estimate; unknown jobs go last, FIFO
        told = replace(job("told", at=0.0, expected_s=10.0), predicted_duration_s=500.0)
        only_user = job("only_user", at=1.0, expected_s=200.0)
        unknown_early = job("unknown_early", at=2.0)
        unknown_late = job("unknown_late", at=3.0)
        got = order(QSSF, unknown_late, told, unknown_early, only_user)
        assert got == ["only_user", "told", "unknown_early", "unknown_late"]

    def test_srtf_orders_by_remaining_time_user_estimate_first(self) -> None:
        a = job("a1", at=0.0, expected_s=300.0)
        b = replace(job("b1", at=1.0, expected_s=100.0), predicted_duration_s=900.0)
        c = replace(job("c1", at=2.0), predicted_duration_s=200.0)
        d = job("d1", at=3.0)
        assert order(SRTF, d, c, b, a) == ["b1", "c1", "a1", "d1"]
        assert remaining_s(b) == 100.0
        assert remaining_s(d) == float("inf")

    @pytest.mark.parametrize("cfg", [QSSF, SRTF])
    def test_equal_estimates_fall_back_to_queue_time(self, cfg: PolicyConfig) -> None:
        first = job("z-first", at=0.0, expected_s=60.0)
        second = job("a-second", at=5.0, expected_s=60.0)
        assert order(cfg, second, first) == ["z-first", "a-second"]
        key = queue_key(cfg)
        assert key(first) < key(second)


class TestShortestFirstPasses:
    def test_qssf_places_the_smallest_service_on_the_last_gpu(self) -> None:
        s = snap(
            [node("n1", free=1)],
            [
                replace(job("old-long", at=0.0), predicted_duration_s=5000.0),
                replace(job("new-short", at=60.0), predicted_duration_s=50.0),
            ],
            teams=[team("a")],
            now=100.0,
        )
        fifo = schedule(s, replace(QSSF, ordering=Ordering.FIFO)).decisions
        assert [d.job_id for d in fifo if isinstance(d, Place)] == ["old-long"]
        got = schedule(s, QSSF).decisions
        assert [d.job_id for d in got if isinstance(d, Place)] == ["new-short"]

    def _busy(self, now: float, short_s: float, team_b: bool = False) -> object:
        # one 8-GPU node: a long job started at 0 with 10,000 s of work (9,000 s left at
        # now = 1,000), and a 4-GPU job waiting whose remaining time is short_s
        return snap(
            [node("n1", free=0)],
            [job("short", gpus=4, at=now - 10.0, expected_s=short_s)],
            running=[run("long", "n1", team="b" if team_b else "a", gpus=8, expected_s=10_000.0)],
            teams=[team("a"), team("b")],
            now=now,
        )

    def test_srtf_preempts_the_job_with_more_remaining_time(self) -> None:
        got = schedule(self._busy(1000.0, 600.0), SRTF)  # type: ignore[arg-type]
        pre = [d for d in got.decisions if isinstance(d, Preempt)]
        assert [(p.for_job_id, p.victim_run_ids, p.reason) for p in pre] == [
            ("short", ("long",), "srtf")
        ]
        reason = got.waiting["short"]
        assert reason.code == "waiting_for_preemption"
        assert "more remaining time" in reason.message

    def test_srtf_leaves_a_job_that_ends_sooner(self) -> None:
        # 9,000 s left on the running job: a waiting job of 9,500 s must not preempt it
        got = schedule(self._busy(1000.0, 9500.0), SRTF)  # type: ignore[arg-type]
        assert not [d for d in got.decisions if isinstance(d, Preempt)]

    def test_srtf_never_preempts_another_team(self) -> None:
        got = schedule(self._busy(1000.0, 600.0, team_b=True), SRTF)  # type: ignore[arg-type]
        assert not [d for d in got.decisions if isinstance(d, Preempt)]

    def test_sjf_is_srtf_without_preemption(self) -> None:
        got = schedule(self._busy(1000.0, 600.0), SJF)  # type: ignore[arg-type]
        assert got.decisions == ()
        assert got.waiting["short"].code != "waiting_for_preemption"

    def test_srtf_never_displaces_an_attempt_past_its_estimate(self) -> None:
        # the running job said 100 s and has run 900 s; its hard limit is 4,000 s away. Its
        # srtf key is 0 (past its estimate: about to end), so a 600 s job waits for it
        s = snap(
            [node("n1", free=0)],
            [job("short", gpus=4, at=990.0, expected_s=600.0)],
            running=[
                run("overdue", "n1", gpus=8, started=100.0, expected_s=100.0, max_runtime_s=5000.0)
            ],
            teams=[team("a")],
            now=1000.0,
        )
        assert not [d for d in schedule(s, SRTF).decisions if isinstance(d, Preempt)]
        # ... while the same attempt inside its estimate (1,000 s of 2,000 s left) is displaced
        inside = replace(s, running=(replace(s.running[0], expected_duration_s=2000.0),))
        pre = [d for d in schedule(inside, SRTF).decisions if isinstance(d, Preempt)]
        assert [p.victim_run_ids for p in pre] == [("overdue",)]

    def test_srtf_remaining_of_an_attempt(self) -> None:
        r = run("r", "n1", started=100.0, expected_s=500.0)
        assert srtf_remaining_s(r, 300.0) == 300.0
        assert srtf_remaining_s(r, 900.0) == 0.0  # past its estimate: never below zero
        assert srtf_remaining_s(replace(r, expected_duration_s=None), 300.0) == math.inf
        predicted = replace(r, expected_duration_s=None, predicted_duration_s=250.0)
        assert srtf_remaining_s(predicted, 300.0) == 50.0

    def test_srtf_victims_longest_remaining_first(self) -> None:
        # two 4-GPU jobs on the node, 2,000 s and 8,000 s left: the 8,000 s one is stopped
        s = snap(
            [node("n1", free=0)],
            [job("short", gpus=4, at=990.0, expected_s=100.0)],
            running=[
                run("ends-soon", "n1", gpus=4, expected_s=3000.0),
                run("ends-late", "n1", gpus=4, expected_s=9000.0),
            ],
            teams=[team("a")],
            now=1000.0,
        )
        pre = [d for d in schedule(s, SRTF).decisions if isinstance(d, Preempt)]
        assert [p.victim_run_ids for p in pre] == [("ends-late",)]
