"""The invariant checker on gang attempts: a healthy gang passes; members with a stale token,
a rank twice, a gang missing members with none stopping, and two accepted completions of one
job do not."""

from __future__ import annotations

import dataclasses

from gpufleet.domain.invariants import (
    InvariantView,
    JobView,
    NodeView,
    ReservationView,
    RunView,
    check_invariants,
)


def gang(statuses: tuple[str, str] = ("RUNNING", "RUNNING"), token: int = 3) -> InvariantView:
    return InvariantView(
        nodes=(
            NodeView("n1", 2, 0, {0: "r0", 1: "r0"}),
            NodeView("n2", 2, 0, {0: "r1", 1: "r1"}),
        ),
        reservations=(
            ReservationView("res0", "r0", "j1", "n1", (0, 1), "CONFIRMED"),
            ReservationView("res1", "r1", "j1", "n2", (0, 1), "CONFIRMED"),
        ),
        jobs=(JobView("j1", "RUNNING", "r0", 3),),
        runs=(
            RunView("r0", "j1", statuses[0], token, False, "n1", rank=0, gang_size=2),
            RunView("r1", "j1", statuses[1], token, False, "n2", rank=1, gang_size=2),
        ),
    )


def codes(view: InvariantView) -> list[int]:
    return [v.invariant for v in check_invariants(view)]


def test_a_running_gang_and_a_stopping_gang_are_healthy() -> None:
    assert check_invariants(gang()) == []
    assert check_invariants(gang(("PREEMPTING", "FAILED"))) == []
    assert check_invariants(gang(("RUNNING", "SUCCEEDED"))) == []


def test_a_member_with_another_token_is_a_violation() -> None:
    view = gang()
    runs = (view.runs[0], dataclasses.replace(view.runs[1], token=2))
    assert 3 in codes(dataclasses.replace(view, runs=runs))


def test_a_rank_held_twice_is_a_violation() -> None:
    view = gang()
    runs = (view.runs[0], dataclasses.replace(view.runs[1], rank=0))
    assert 3 in codes(dataclasses.replace(view, runs=runs))


def test_a_gang_missing_a_member_with_none_stopping_is_a_violation() -> None:
    view = gang()
    alone = dataclasses.replace(
        view,
        runs=(view.runs[0],),
        reservations=(view.reservations[0],),
        nodes=(view.nodes[0], NodeView("n2", 2, 2, {0: None, 1: None})),
    )
    assert codes(alone) == [3]


def test_every_member_succeeding_is_one_accepted_completion() -> None:
    view = gang()
    done = dataclasses.replace(
        view,
        jobs=(JobView("j1", "SUCCEEDED", "r0", 3),),
        reservations=(),
        nodes=tuple(dataclasses.replace(n, available_gpus=2, gpu_holders={}) for n in view.nodes),
        runs=tuple(
            dataclasses.replace(r, status="SUCCEEDED", completion_accepted=True) for r in view.runs
        ),
    )
    assert check_invariants(done) == []
    twice = dataclasses.replace(
        done, runs=tuple(dataclasses.replace(r, rank=0) for r in done.runs)
    )
    assert 4 in codes(twice)


def test_a_retried_gang_whose_rank_0_succeeded_each_time_is_not_two_results() -> None:
    """Rank 1 failed in both attempts while rank 0 exited 0: the job FAILED, neither attempt
    is a result (a new-user run of `gpufleet admin check` reported '2 accepted completions')."""
    view = gang()

    def attempt(token: int, rank1: str) -> tuple[RunView, ...]:
        return (
            dataclasses.replace(
                view.runs[0],
                run_id=f"a{token}r0",
                token=token,
                status="SUCCEEDED",
                completion_accepted=True,
            ),
            dataclasses.replace(
                view.runs[1],
                run_id=f"a{token}r1",
                token=token,
                status=rank1,
                completion_accepted=rank1 == "SUCCEEDED",
            ),
        )

    ended = dataclasses.replace(
        view,
        jobs=(JobView("j1", "FAILED", "a2r0", 2),),
        reservations=(),
        nodes=tuple(dataclasses.replace(n, available_gpus=2, gpu_holders={}) for n in view.nodes),
        runs=(*attempt(1, "FAILED"), *attempt(2, "FAILED")),
    )
    assert check_invariants(ended) == []
    # a first attempt that was a whole result, then another one: two results
    twice = dataclasses.replace(
        ended,
        jobs=(JobView("j1", "SUCCEEDED", "a2r0", 2),),
        runs=(*attempt(1, "SUCCEEDED"), *attempt(2, "SUCCEEDED")),
    )
    assert codes(twice) == [4]
