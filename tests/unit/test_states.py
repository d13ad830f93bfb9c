"""The transition tables: every pair of states is either an edge or raises."""

from __future__ import annotations

import itertools

import pytest

from gpufleet.domain.errors import IllegalTransition
from gpufleet.domain.states import (
    JOB_TERMINAL,
    RESERVATION_TERMINAL,
    RUN_TERMINAL,
    TABLES,
    JobStatus,
    Machine,
    NodeStatus,
    ReservationStatus,
    RunStatus,
    check_transition,
)

ENUMS = {
    Machine.JOB: JobStatus,
    Machine.RUN: RunStatus,
    Machine.RESERVATION: ReservationStatus,
    Machine.NODE: NodeStatus,
}


@pytest.mark.parametrize("machine", list(Machine))
def test_every_pair_is_allowed_or_raises(machine: Machine) -> None:
    states = list(ENUMS[machine])
    for frm, to in itertools.product(states, states):
        if (frm, to) in TABLES[machine]:
            assert check_transition(machine, frm, to) == TABLES[machine][(frm, to)]
        else:
            with pytest.raises(IllegalTransition):
                check_transition(machine, frm, to)


def test_terminal_states_are_derived_from_the_tables() -> None:
    assert {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.CANCELLED,
        JobStatus.EXPIRED,
        JobStatus.DEPENDENCY_FAILED,
    } == JOB_TERMINAL
    assert {
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.PREEMPTED,
        RunStatus.CANCELLED,
        RunStatus.FENCED,
    } == RUN_TERMINAL
    assert {ReservationStatus.RELEASED, ReservationStatus.EXPIRED} == RESERVATION_TERMINAL


def test_no_edge_frees_a_reservation_without_a_named_trigger() -> None:
    """RELEASED/EXPIRED only through the agent's word or reconciliation, never a timer."""
    triggers = {
        t for (f, to), t in TABLES[Machine.RESERVATION].items() if to in RESERVATION_TERMINAL
    }
    assert triggers == {
        "RELEASED_ON_AGENT_WORD",
        "EXPIRED_AFTER_RECONCILE",
        "AGENT_REPORTED_GONE",
        "OPERATOR_CONFIRMED_DEAD",
    }


def test_a_fenced_attempts_gpus_come_back_only_on_the_agents_or_an_operators_word() -> None:
    """QUARANTINED leads only to RELEASED (the agent reported the run gone) or EXPIRED (an
    operator confirmed the node dead): fencing itself never frees GPUs."""
    out = {(to, t) for (f, to), t in TABLES[Machine.RESERVATION].items() if f == "QUARANTINED"}
    assert out == {
        (ReservationStatus.RELEASED, "AGENT_REPORTED_GONE"),
        (ReservationStatus.EXPIRED, "OPERATOR_CONFIRMED_DEAD"),
    }


def test_only_transitions_module_writes_status() -> None:
    """A source check: no module other than store/transitions.py assigns ``row.status``
    (constructors that insert a row in its initial state are fine; the agent's and the
    simulator's own in-memory records are not database rows)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "src" / "gpufleet"
    pattern = re.compile(r"\.status\s*=(?!=)")
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("store/transitions.py", "sim/", "agent/", "rpc/", "store/migrations/")):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert offenders == [], offenders
