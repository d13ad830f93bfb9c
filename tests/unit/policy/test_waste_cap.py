"""The preemption waste cap (``policy.waste``): a preemption whose victims would lose more
work (GPUs x time since their last checkpoint) than a team's or the fleet's cap has left in
its rolling window is not made, and ``why`` says so; one within it is."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.policy.policy_builders import job, node, run, snap, team

from gpufleet.domain.types import PriorityClass as P
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill, Preempt
from gpufleet.policy.snapshot import BackfillReservation, ClusterSnapshot
from gpufleet.policy.waste import (
    WASTE_CAP,
    Waste,
    WasteLimit,
    WasteState,
    lost_gpu_h,
    waste_by_team,
)

HOUR = 3600.0
NOW = 10 * HOUR


def priority_case(checkpoint: float | None = None, **extra: object) -> ClusterSnapshot:
    """Team a runs a LOW 8-GPU job on the only node, started an hour ago (8 GPU-h lost without
    a checkpoint); a CRITICAL 8-GPU job of team a waits."""
    s = snap(
        nodes=[node("n1", free=0)],
        running=[
            run(
                "low",
                "n1",
                team="a",
                gpus=8,
                priority=P.LOW,
                started=NOW - HOUR,
                checkpoint=checkpoint,
            )
        ],
        pending=[job("crit", team="a", gpus=8, priority=P.CRITICAL, at=NOW - 10)],
        teams=[team("a", guarantee=8)],
        now=NOW,
    )
    return replace(s, **extra)  # type: ignore[arg-type]


def preempts(result: object) -> list[Preempt]:
    return [d for d in result.decisions if isinstance(d, Preempt)]  # type: ignore[attr-defined]


def test_without_caps_the_preemption_is_made() -> None:
    result = schedule(priority_case())
    (pre,) = preempts(result)
    assert pre.victim_run_ids == ("low",)


def test_a_team_cap_below_the_loss_refuses_the_preemption_and_why_says_so() -> None:
    state = WasteState(team_caps={"a": WasteLimit(5.0, 24 * HOUR)})
    result = schedule(priority_case(preemption_waste=state))
    assert preempts(result) == []
    why = result.waiting["crit"]
    assert why.code == WASTE_CAP
    assert "team a's preemption waste cap (5 GPU-h per 1 d" in why.message
    assert "lose 8 GPU-h" in why.message
    cap = why.details["waste_cap"]
    assert cap["scope"] == "team" and cap["loss_gpu_h"] == 8.0 and cap["used_gpu_h"] == 0.0
    assert why.details["otherwise"] == "no_node_fits_now"


def test_a_team_cap_with_room_allows_it() -> None:
    state = WasteState(team_caps={"a": WasteLimit(10.0, 24 * HOUR)})
    (pre,) = preempts(schedule(priority_case(preemption_waste=state)))
    assert pre.victim_run_ids == ("low",)


def test_a_fresh_checkpoint_loses_little_and_fits_the_cap() -> None:
    state = WasteState(team_caps={"a": WasteLimit(1.0, 24 * HOUR)})
    # checkpointed 6 minutes ago: 8 GPUs x 0.1 h = 0.8 GPU-h
    (pre,) = preempts(schedule(priority_case(NOW - 360, preemption_waste=state)))
    assert pre.victim_run_ids == ("low",)


def test_earlier_losses_inside_the_window_count_and_older_ones_do_not() -> None:
    cap = {"a": WasteLimit(10.0, 24 * HOUR)}
    inside = WasteState((Waste("a", NOW - 23 * HOUR, 4.0),), cap)
    assert preempts(schedule(priority_case(preemption_waste=inside))) == []
    outside = WasteState((Waste("a", NOW - 25 * HOUR, 4.0), Waste("b", NOW - 60, 9.0)), cap)
    assert len(preempts(schedule(priority_case(preemption_waste=outside)))) == 1


def test_the_fleet_cap_counts_every_teams_losses() -> None:
    cfg = PolicyConfig(preemption_waste_gpu_h=10.0, preemption_waste_window_s=24 * HOUR)
    assert len(preempts(schedule(priority_case(), cfg))) == 1
    others = WasteState((Waste("b", NOW - 60, 3.0),))
    result = schedule(priority_case(preemption_waste=others), cfg)
    assert preempts(result) == []
    assert result.waiting["crit"].details["waste_cap"]["scope"] == "fleet"
    assert "the fleet's preemption waste cap" in result.waiting["crit"].message


def test_preemptions_of_one_pass_are_charged_before_the_next() -> None:
    """Two teams each reclaim a borrowed 8-GPU loan worth 4 GPU-h; a fleet cap of 6 GPU-h
    lets the first through only."""
    s = snap(
        nodes=[node("n1", free=0), node("n2", free=0), node("n3", free=0)],
        running=[
            run("c1", "n1", team="c", gpus=8, started=NOW - HOUR / 2),
            run("c2", "n2", team="c", gpus=8, started=NOW - HOUR / 2),
            run("c0", "n3", team="c", gpus=8, started=0, preemptible=False),
        ],
        pending=[job("a1", team="a", gpus=8, at=NOW - 5), job("b1", team="b", gpus=8, at=NOW - 5)],
        teams=[team("a", guarantee=8), team("b", guarantee=8), team("c", guarantee=8)],
        now=NOW,
    )
    free = schedule(s)
    assert len(preempts(free)) == 2
    capped = schedule(
        replace(s, preemption_waste=WasteState()), PolicyConfig(preemption_waste_gpu_h=6.0)
    )
    (pre,) = preempts(capped)
    other = "b1" if pre.for_job_id == "a1" else "a1"
    assert capped.waiting[other].code == WASTE_CAP
    assert capped.waiting[other].details["waste_cap"]["used_gpu_h"] == 4.0


def test_a_victim_teams_cap_does_not_limit_other_teams() -> None:
    """Team c's loans are reclaimed; only c's cap (as victim) matters, not the preemptor's."""
    s = snap(
        nodes=[node("n1", free=0), node("n2", free=0)],
        running=[
            run("c1", "n1", team="c", gpus=8, started=NOW - HOUR),
            run("c0", "n2", team="c", gpus=8, started=0, preemptible=False),
        ],
        pending=[job("a1", team="a", gpus=8, at=NOW - 5)],
        teams=[team("a", guarantee=8), team("c", guarantee=8)],
        now=NOW,
    )
    a_capped = WasteState(team_caps={"a": WasteLimit(0.0)})
    assert len(preempts(schedule(replace(s, preemption_waste=a_capped)))) == 1
    c_capped = WasteState(team_caps={"c": WasteLimit(0.0)})
    result = schedule(replace(s, preemption_waste=c_capped))
    assert preempts(result) == []
    assert result.waiting["a1"].details["waste_cap"]["team_id"] == "c"


def test_loss_and_window_sums() -> None:
    r = run("r", "n1", gpus=4, started=0.0, checkpoint=1800.0)
    assert lost_gpu_h(r, 3600.0) == 2.0
    assert lost_gpu_h(run("s", "n1", gpus=2, started=0.0), 3600.0) == 2.0
    recent = (Waste("a", 100.0, 1.0), Waste("a", 200.0, 2.0), Waste("b", 200.0, 5.0))
    assert waste_by_team(recent, 250.0, 100.0) == {"a": 2.0, "b": 5.0}


def test_the_caps_reason_stays_while_it_holds_and_promises_no_start() -> None:
    """The victim has a known end (so the refused job gets a reservation): pass after pass,
    with the reservation of the pass before, the reason stays ``preemption_waste_cap`` with no
    start promised; once the cap has room the preemption is made."""
    state = WasteState(team_caps={"a": WasteLimit(5.0, 24 * HOUR)})
    s = priority_case(preemption_waste=state)
    s = replace(s, running=(replace(s.running[0], max_runtime_s=2 * HOUR),))
    result = schedule(s)
    for _ in range(3):
        assert preempts(result) == []
        why = result.waiting["crit"]
        assert why.code == WASTE_CAP, why
        assert why.estimated_start_s is None
        assert "expected to start" not in why.message and "held for it" in why.message
        holds = [d for d in result.decisions if isinstance(d, HoldForBackfill)]
        res = tuple(
            BackfillReservation(h.job_id, h.node_id, h.gpu_count, h.start_at_s) for h in holds
        )
        assert res, result.decisions
        s = replace(s, reservations=res)
        result = schedule(s)
    roomy = WasteState(team_caps={"a": WasteLimit(10.0, 24 * HOUR)})
    (pre,) = preempts(schedule(replace(s, preemption_waste=roomy)))
    assert pre.victim_run_ids == ("low",)


def test_small_waste_figures_keep_three_significant_digits() -> None:
    state = WasteState((Waste("a", NOW - 60, 0.006),), team_caps={"a": WasteLimit(0.01, HOUR)})
    why = schedule(priority_case(preemption_waste=state)).waiting["crit"]
    assert "(0.01 GPU-h per 1 h, 0.006 used)" in why.message, why.message
    assert why.details["waste_cap"]["used_gpu_h"] == 0.006
