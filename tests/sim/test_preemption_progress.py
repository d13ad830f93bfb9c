"""A preemption must lead to its preemptor running: the GPUs it frees are held for it until
it starts, and a lower tier's backfill reservation does not stand in its way. Both failures
below were found by a user's synthetic scenario (a HIGH 24-GPU gang among LOW 16-GPU gangs of
its own team) that never ended: the gang preempted one node per grace period for ever."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import PolicyConfig
from gpufleet.sim.cli import run_scenario
from gpufleet.sim.config import load_scenario
from gpufleet.sim.engine import Engine, EngineOptions
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

GRACE = 60.0
DATA = Path(__file__).resolve().parent / "data"


def test_a_gang_preemptor_keeps_the_holds_of_its_earlier_preemptions() -> None:
    """Six 8-GPU nodes; x (guarantee 24, may borrow 8) runs LOW 16-GPU gangs; a HIGH 24-GPU
    gang arrives and needs three nodes, one freed per pass. The engine used to drop a
    preemptor's older holds at each new preemption, so the node freed a grace period
    earlier went to the next LOW gang, which the HIGH gang preempted again: 61 preemptions
    here, and without end in the user's scenario."""
    jobs = [
        SimJob("j06", "x", 659.0, 16, 5_828.0, priority=P.LOW, checkpoint_s=300.0),
        SimJob("j01", "x", 3_100.0, 16, 23_290.0, priority=P.LOW, checkpoint_s=300.0),
        SimJob("j05", "x", 3_713.0, 16, 1_582.0, priority=P.LOW, checkpoint_s=300.0),
        SimJob("j03", "x", 5_194.0, 24, 564.0, priority=P.HIGH, checkpoint_s=300.0),
        SimJob("j02", "x", 8_200.0, 16, 4_171.0, priority=P.LOW, checkpoint_s=300.0),
        SimJob("j00", "x", 8_750.0, 8, 267.0, priority=P.HIGH, checkpoint_s=300.0),
        SimJob("j07", "x", 12_217.0, 16, 23_566.0, priority=P.LOW, checkpoint_s=300.0),
        SimJob("j04", "x", 14_991.0, 8, 2_226.0, priority=P.LOW, checkpoint_s=300.0),
    ]
    teams = [
        TeamSpec("x", guaranteed_gpus={"A100": 24}, borrow_limit_gpus=8),
        TeamSpec("y", guaranteed_gpus={"A100": 16}),
    ]
    eng = Engine(
        [NodeGroup("n", 6, 8, "A100")],
        teams,
        jobs,
        PolicyConfig(),
        EngineOptions(grace_s=GRACE, horizon_s=1e6),
    )
    eng.run()
    assert not eng.rec.unfinished
    # the GPUs each stop freed stayed held for the HIGH gang (one node per pass, three
    # passes), so it never had to take a node back: three preemptions for it (61 before)
    assert eng.rec.preemptions <= 4


def test_a_lower_tier_reservation_does_not_hold_back_a_higher_tier_of_its_team() -> None:
    """Three 8-GPU nodes, all x's: two LOW jobs run, a HIGH 24-GPU gang arrives and a stream
    of LOW 8-GPU jobs follows. A LOW job's backfill reservation of an earlier pass was kept
    before the HIGH gang was considered: it made that LOW job the team's head for the pass
    (no preemption for the gang) and its shadow kept the gang off its node, so the gang
    waited 41 hours, until the LOW stream ran dry."""
    jobs = [
        SimJob("s0", "x", 0.0, 8, 50_000.0, priority=P.LOW, expected_duration_s=50_000.0),
        SimJob("s1", "x", 1.0, 8, 50_000.0, priority=P.LOW, expected_duration_s=50_000.0),
        SimJob("h", "x", 100.0, 24, 600.0, priority=P.HIGH, expected_duration_s=600.0),
    ]
    jobs += [
        SimJob(f"l{i:03d}", "x", 100.5 + i, 8, 50_000.0, priority=P.LOW, expected_duration_s=5e4)
        for i in range(20)
    ]
    eng = Engine(
        [NodeGroup("n", 3, 8, "A100")],
        [TeamSpec("x", guaranteed_gpus={"A100": 24})],
        jobs,
        PolicyConfig(),
        EngineOptions(grace_s=GRACE, horizon_s=2e6),
    )
    eng.run()
    start = eng.fleet.jobs["h"].first_start_s
    assert start is not None and start <= 100.0 + 3 * GRACE
    assert not eng.rec.unfinished


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "was"), [(0, 1_131), (7, 1_076)])
def test_the_users_scenario_ends_without_a_preemption_loop(seed: int, was: int) -> None:
    """The user's scenario (tests/sim/data/priority_gangs.yaml). Before the three fixes it
    never ended at seed 7 (1,076 preemptions by 200,000 s) and at seed 0 made ``was``
    preemptions, with a HIGH gang waiting 4,979,416 s (57 days) behind LOW gangs it kept
    displacing. Team x's own work keeps it busy for weeks (log-normal run times, sigma 2, at
    most 32 GPUs), so the run is long; what must not happen is the displacing."""
    sc = load_scenario(DATA / "priority_gangs.yaml", seed=seed)
    eng, rep = run_scenario(sc, sc.policy)
    assert eng.violations == 0
    assert not eng.rec.unfinished
    assert rep["preemption"]["count"] < was // 5
    # no job is displaced over and over (measured: at most 6 times here, against 18 when a
    # preemption could leave its preemptor over its team's borrow limit)
    assert max(r.preemptions for r in eng.rec.records) <= 8
