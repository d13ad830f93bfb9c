"""The invariant checker finds each kind of violation (and nothing in a healthy view)."""

from __future__ import annotations

import pytest

from gpufleet.domain.invariants import (
    InvariantView,
    JobView,
    NodeView,
    ReservationView,
    RunView,
    check_invariants,
)

HEALTHY = InvariantView(
    nodes=(NodeView("n1", 8, 6, {0: "r1", 1: "r1", **dict.fromkeys(range(2, 8))}),),
    reservations=(ReservationView("res1", "r1", "j1", "n1", (0, 1), "CONFIRMED"),),
    jobs=(JobView("j1", "RUNNING", "r1", 1),),
    runs=(RunView("r1", "j1", "RUNNING", 1, False),),
)


def test_a_healthy_view_has_no_violation() -> None:
    assert check_invariants(HEALTHY) == []


@pytest.mark.parametrize(
    ("view", "want_invariant"),
    [
        pytest.param(
            InvariantView(
                (NodeView("n1", 8, 7, {0: "r1", 1: "r1"}),),
                HEALTHY.reservations,
                HEALTHY.jobs,
                HEALTHY.runs,
            ),
            1,
            id="reserved + available != total",
        ),
        pytest.param(
            InvariantView(
                (NodeView("n1", 8, 4, {0: "r1", 1: "r2"}),),
                (
                    *HEALTHY.reservations,
                    ReservationView("res2", "r2", "j2", "n1", (1, 2), "RESERVED"),
                ),
                (*HEALTHY.jobs, JobView("j2", "SCHEDULED", "r2", 1)),
                (*HEALTHY.runs, RunView("r2", "j2", "ASSIGNED", 1, False)),
            ),
            2,
            id="one GPU, two holders",
        ),
        pytest.param(
            InvariantView(
                HEALTHY.nodes,
                HEALTHY.reservations,
                (JobView("j1", "SUCCEEDED", "r1", 1),),
                HEALTHY.runs,
            ),
            3,
            id="terminal job holds a reservation",
        ),
        pytest.param(
            InvariantView(
                HEALTHY.nodes,
                HEALTHY.reservations,
                HEALTHY.jobs,
                (*HEALTHY.runs, RunView("r0", "j1", "ASSIGNED", 0, False)),
            ),
            3,
            id="two active attempts",
        ),
        pytest.param(
            InvariantView(
                (),
                (),
                (JobView("j1", "SUCCEEDED", "r2", 2),),
                (
                    RunView("r1", "j1", "SUCCEEDED", 1, True),
                    RunView("r2", "j1", "SUCCEEDED", 2, True),
                ),
            ),
            4,
            id="two accepted results",
        ),
    ],
)
def test_each_violation_is_found(view: InvariantView, want_invariant: int) -> None:
    found = check_invariants(view)
    assert want_invariant in {v.invariant for v in found}, found
