"""Gangs in the simulator: the same policy places multi-node jobs; members start, end and
stop together; the invariants (checked after every pass) know gangs."""

from __future__ import annotations

import pytest

from gpufleet.domain.states import RunStatus
from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import Backfill, PolicyConfig
from gpufleet.sim.engine import Engine, EngineOptions
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

BIG_SUBMIT_S = 1800.0
LONGEST_SMALL_S = 1200.0


def loaded_fleet_with_a_64_gpu_job() -> list[SimJob]:
    """16 x 8 GPUs; team a submits a 1-4 GPU job every 8 s (300-1200 s each, ~1.5x what the
    fleet can run), team b one 64-GPU job at t=1800."""
    jobs = []
    durations = (300.0, 600.0, LONGEST_SMALL_S, 900.0)
    for i in range(900):
        g, d = (1, 2, 4, 1)[i % 4], durations[i % 4]
        jobs.append(SimJob(f"a-{i:04d}", "a", i * 8.0, g, d, expected_duration_s=d))
    jobs.append(SimJob("big", "b", BIG_SUBMIT_S, 64, 3600.0, expected_duration_s=3600.0))
    return jobs


def run_big(backfill: Backfill) -> Engine:
    eng = Engine(
        [NodeGroup("n", 16, 8, "A100")],
        [TeamSpec("a"), TeamSpec("b")],
        loaded_fleet_with_a_64_gpu_job(),
        PolicyConfig(backfill=backfill),
        EngineOptions(check_invariants="every_pass"),
    )
    eng.run()
    return eng


class TestLargeGangUnderLoad:
    def test_starts_within_the_drain_bound_while_small_jobs_flow(self) -> None:
        eng = run_big(Backfill.EASY)
        assert eng.violations == 0
        big = eng.fleet.jobs["big"]
        assert big.first_start_s is not None
        # the backfill hold: 8 nodes are held from the first pass after submission and
        # drain within the longest small job
        assert eng.first_reservation_s["big"] <= BIG_SUBMIT_S + LONGEST_SMALL_S
        assert big.first_start_s - BIG_SUBMIT_S <= LONGEST_SMALL_S
        (run_id,) = big.runs
        members = eng.fleet.runs[run_id].members
        assert [len(m.gpu_ids) for m in members] == [8] * 8
        assert len({m.node_id for m in members}) == 8
        started_while_waiting = [
            js
            for js in eng.fleet.jobs.values()
            if js.spec.team_id == "a"
            and js.first_start_s is not None
            and BIG_SUBMIT_S <= js.first_start_s < big.first_start_s
        ]
        assert len(started_while_waiting) >= 10  # small jobs keep flowing on the other nodes
        assert all(js.status == "SUCCEEDED" for js in eng.fleet.jobs.values())

    def test_without_the_hold_it_starves_behind_the_stream(self) -> None:
        greedy = run_big(Backfill.GREEDY).fleet.jobs["big"]
        assert greedy.first_start_s is not None
        assert greedy.first_start_s - BIG_SUBMIT_S > 5 * LONGEST_SMALL_S


class TestGangLifecycle:
    def test_members_end_together_and_release_every_node(self) -> None:
        jobs = [SimJob("g", "a", 0.0, 16, 100.0, expected_duration_s=100.0)]
        jobs.append(SimJob("after", "a", 1.0, 8, 10.0))
        eng = Engine(
            [NodeGroup("n", 2, 8, "A100")],
            [TeamSpec("a")],
            jobs,
            PolicyConfig(),
            EngineOptions(check_invariants="every_event"),
        )
        eng.run()
        g = eng.fleet.jobs["g"]
        run = eng.fleet.runs[g.runs[0]]
        assert run.status is RunStatus.SUCCEEDED
        assert {m.node_id for m in run.members} == {"n-0000", "n-0001"}
        assert g.end_s == pytest.approx(100.0)
        assert eng.fleet.jobs["after"].first_start_s == pytest.approx(100.0)
        assert all(n.free == 8 for n in eng.fleet.nodes.values())

    def test_preempting_a_member_stops_the_whole_gang(self) -> None:
        """A HIGH 8-GPU job preempts a LOW 2-node gang: the gang's one attempt goes
        PREEMPTING, both nodes are released together after the grace period, and the gang
        is requeued and restarts as one new attempt."""
        jobs = [
            SimJob("g", "a", 0.0, 16, 1000.0, priority=P.LOW, expected_duration_s=1000.0),
            SimJob("hi", "a", 50.0, 8, 100.0, priority=P.HIGH, expected_duration_s=100.0),
        ]
        eng = Engine(
            [NodeGroup("n", 2, 8, "A100")],
            [TeamSpec("a", guaranteed_gpus={"A100": 16})],
            jobs,
            PolicyConfig(),
            EngineOptions(grace_s=30.0, check_invariants="every_event"),
        )
        eng.run()
        g = eng.fleet.jobs["g"]
        first, second = (eng.fleet.runs[r] for r in g.runs)
        assert first.status is RunStatus.PREEMPTED
        assert first.released_s == pytest.approx(80.0)
        assert len(first.members) == len(second.members) == 2
        assert eng.fleet.jobs["hi"].first_start_s == pytest.approx(80.0)
        assert second.reserved_s == pytest.approx(180.0)  # after hi ends, both nodes again
        assert eng.rec.preemptions == 1

    def test_a_gang_no_fleet_can_hold_is_rejected_at_arrival(self) -> None:
        eng = Engine(
            [NodeGroup("n", 2, 8, "A100")],
            [TeamSpec("a")],
            [SimJob("g", "a", 0.0, 24, 10.0), SimJob("ok", "a", 0.0, 16, 10.0)],
            PolicyConfig(),
        )
        eng.run()
        assert eng.fleet.jobs["g"].status == "EXPIRED"
        assert eng.fleet.jobs["ok"].status == "SUCCEEDED"
