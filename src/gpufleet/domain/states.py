"""The state machines: one table per machine mapping ``(from, to)`` to a named trigger.

This module is the single definition of what may change into what. ``store/transitions.py``
is the single writer of ``status`` columns and calls :func:`check_transition` before every
guarded UPDATE; the simulator calls it too. Terminal states are derived: states with no
outgoing edge.

No edge frees capacity on a timer: every path of a reservation to RELEASED or EXPIRED is
taken on the agent's word (stopped, never started, completed) or an operator's fence.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, TypeVar

from gpufleet.domain.errors import IllegalTransition


class JobStatus(enum.StrEnum):
    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"
    DEPENDENCY_FAILED = "DEPENDENCY_FAILED"
    """One of its dependencies can never be satisfied (``afterok`` on a job that did not
    succeed, ``afternotok`` on one that succeeded or never ran): it never ran and never
    will (``policy.gates``)."""


class RunStatus(enum.StrEnum):
    ASSIGNED = "ASSIGNED"
    RUNNING = "RUNNING"
    PREEMPTING = "PREEMPTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"
    CANCELLED = "CANCELLED"
    FENCED = "FENCED"
    """Its node was lost (silent past the fence timeout, its agent's state wiped, or an
    operator's fence): the token is revoked, the job moved on; the GPUs stay QUARANTINED."""


class ReservationStatus(enum.StrEnum):
    RESERVED = "RESERVED"
    CONFIRMED = "CONFIRMED"
    RELEASED = "RELEASED"
    EXPIRED = "EXPIRED"
    QUARANTINED = "QUARANTINED"
    """The attempt was fenced but nobody has said its processes are gone: the GPUs are not
    offered until the agent reports the run gone or an operator confirms the node dead."""


class NodeStatus(enum.StrEnum):
    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    QUARANTINED = "QUARANTINED"
    CORDONED = "CORDONED"
    DRAINING = "DRAINING"
    FENCED = "FENCED"
    UNHEALTHY = "UNHEALTHY"
    """The agent reports a failed check (disk below its reserve, repeated start failures):
    no placements until the check passes again."""


class Machine(enum.StrEnum):
    JOB = "job"
    RUN = "run"
    RESERVATION = "reservation"
    NODE = "node"


J, R, V, N = JobStatus, RunStatus, ReservationStatus, NodeStatus

JOB_TRANSITIONS: Final[Mapping[tuple[JobStatus, JobStatus], str]] = MappingProxyType(
    {
        (J.PENDING, J.SCHEDULED): "RESERVED",
        (J.PENDING, J.CANCELLED): "CANCELLED_WHILE_PENDING",
        (J.PENDING, J.EXPIRED): "EXPIRED_IN_QUEUE",
        (J.SCHEDULED, J.RUNNING): "AGENT_CONFIRMED",
        (J.SCHEDULED, J.PENDING): "REQUEUED",
        (J.SCHEDULED, J.SUCCEEDED): "COMPLETED",
        (J.SCHEDULED, J.FAILED): "FAILED_NO_RETRIES_LEFT",
        (J.SCHEDULED, J.CANCELLED): "CANCELLED",
        (J.RUNNING, J.SUCCEEDED): "COMPLETED",
        (J.RUNNING, J.FAILED): "FAILED_NO_RETRIES_LEFT",
        (J.RUNNING, J.CANCELLED): "CANCELLED",
        (J.RUNNING, J.PENDING): "REQUEUED",
        (J.PENDING, J.DEPENDENCY_FAILED): "DEPENDENCY_NEVER_SATISFIED",
        # a user's requeue of a finished, unsuccessful job: a new attempt (POST .../requeue).
        # These edges reopen a finished job; they do not make its state non-terminal (see
        # REOPEN_TRIGGERS). SUCCEEDED is never reopened: its result is the job's result.
        (J.FAILED, J.PENDING): "REQUEUED_BY_USER",
        (J.CANCELLED, J.PENDING): "REQUEUED_BY_USER",
        (J.EXPIRED, J.PENDING): "REQUEUED_BY_USER",
        (J.DEPENDENCY_FAILED, J.PENDING): "REQUEUED_BY_USER",
    }
)

REOPEN_TRIGGERS: Final = frozenset({"REQUEUED_BY_USER"})
"""Edges out of a finished state taken only on a user's explicit request: a state whose only
exits are these is still terminal (nothing in the system moves it on by itself)."""

RUN_TRANSITIONS: Final[Mapping[tuple[RunStatus, RunStatus], str]] = MappingProxyType(
    {
        (R.ASSIGNED, R.RUNNING): "AGENT_CONFIRMED",
        (R.ASSIGNED, R.SUCCEEDED): "COMPLETED",  # the confirm was lost, the manifest proves it ran
        (R.ASSIGNED, R.FAILED): "NEVER_STARTED_OR_EXITED",
        (R.ASSIGNED, R.PREEMPTING): "STOP_REQUESTED",
        (R.RUNNING, R.SUCCEEDED): "COMPLETED",
        (R.RUNNING, R.FAILED): "EXITED_NONZERO",
        (R.RUNNING, R.PREEMPTING): "STOP_REQUESTED",
        (R.PREEMPTING, R.PREEMPTED): "STOPPED_FOR_PREEMPTION",
        (R.PREEMPTING, R.CANCELLED): "STOPPED_FOR_CANCEL",
        (R.PREEMPTING, R.FAILED): "STOPPED_FOR_TIMEOUT",
        (R.PREEMPTING, R.SUCCEEDED): "COMPLETED_BEFORE_STOP",
        (R.ASSIGNED, R.FENCED): "NODE_FENCED",
        (R.RUNNING, R.FENCED): "NODE_FENCED",
        (R.PREEMPTING, R.FENCED): "NODE_FENCED",
    }
)

RESERVATION_TRANSITIONS: Final[Mapping[tuple[ReservationStatus, ReservationStatus], str]] = (
    MappingProxyType(
        {
            (V.RESERVED, V.CONFIRMED): "AGENT_CONFIRMED",
            (V.RESERVED, V.RELEASED): "RELEASED_ON_AGENT_WORD",
            (V.CONFIRMED, V.RELEASED): "RELEASED_ON_AGENT_WORD",
            (V.RESERVED, V.EXPIRED): "EXPIRED_AFTER_RECONCILE",
            (V.CONFIRMED, V.EXPIRED): "EXPIRED_AFTER_RECONCILE",
            (V.RESERVED, V.QUARANTINED): "NODE_FENCED",
            (V.CONFIRMED, V.QUARANTINED): "NODE_FENCED",
            (V.QUARANTINED, V.RELEASED): "AGENT_REPORTED_GONE",
            (V.QUARANTINED, V.EXPIRED): "OPERATOR_CONFIRMED_DEAD",
        }
    )
)

NODE_TRANSITIONS: Final[Mapping[tuple[NodeStatus, NodeStatus], str]] = MappingProxyType(
    {
        (N.HEALTHY, N.SUSPECT): "HEARTBEATS_MISSED",
        (N.SUSPECT, N.HEALTHY): "HEARTBEAT_RESUMED",
        (N.SUSPECT, N.QUARANTINED): "UNREACHABLE",
        (N.HEALTHY, N.QUARANTINED): "AGENT_STATE_LOST",
        (N.UNHEALTHY, N.QUARANTINED): "AGENT_STATE_LOST",
        (N.QUARANTINED, N.HEALTHY): "FENCED_RUNS_GONE",
        (N.HEALTHY, N.UNHEALTHY): "HEALTH_CHECK_FAILED",
        (N.SUSPECT, N.UNHEALTHY): "HEALTH_CHECK_FAILED",
        (N.UNHEALTHY, N.HEALTHY): "HEALTH_CHECK_PASSED",
        (N.UNHEALTHY, N.SUSPECT): "HEARTBEATS_MISSED",
        (N.UNHEALTHY, N.CORDONED): "OPERATOR_CORDON",
        (N.UNHEALTHY, N.DRAINING): "OPERATOR_DRAIN",
        (N.UNHEALTHY, N.FENCED): "OPERATOR_FENCE",
        (N.QUARANTINED, N.CORDONED): "OPERATOR_CORDON",
        (N.SUSPECT, N.DRAINING): "OPERATOR_DRAIN",
        (N.CORDONED, N.CORDONED): "OPERATOR_CORDON",
        (N.FENCED, N.CORDONED): "OPERATOR_CORDON",
        (N.HEALTHY, N.CORDONED): "OPERATOR_CORDON",
        (N.SUSPECT, N.CORDONED): "OPERATOR_CORDON",
        (N.CORDONED, N.HEALTHY): "OPERATOR_UNCORDON",
        (N.HEALTHY, N.DRAINING): "OPERATOR_DRAIN",
        (N.CORDONED, N.DRAINING): "OPERATOR_DRAIN",
        (N.DRAINING, N.CORDONED): "DRAINED",
        (N.DRAINING, N.HEALTHY): "OPERATOR_UNCORDON",
        (N.HEALTHY, N.FENCED): "OPERATOR_FENCE",
        (N.SUSPECT, N.FENCED): "OPERATOR_FENCE",
        (N.QUARANTINED, N.FENCED): "OPERATOR_FENCE",
        (N.CORDONED, N.FENCED): "OPERATOR_FENCE",
        (N.DRAINING, N.FENCED): "OPERATOR_FENCE",
        (N.FENCED, N.HEALTHY): "OPERATOR_UNFENCE",
    }
)

TABLES: Final[Mapping[Machine, Mapping[tuple[str, str], str]]] = MappingProxyType(
    {
        Machine.JOB: JOB_TRANSITIONS,  # type: ignore[dict-item]
        Machine.RUN: RUN_TRANSITIONS,  # type: ignore[dict-item]
        Machine.RESERVATION: RESERVATION_TRANSITIONS,  # type: ignore[dict-item]
        Machine.NODE: NODE_TRANSITIONS,  # type: ignore[dict-item]
    }
)

S = TypeVar("S", bound=enum.StrEnum)


def _terminal(states: type[S], table: Mapping[tuple[S, S], str]) -> frozenset[S]:
    has_exit = {frm for (frm, _), trigger in table.items() if trigger not in REOPEN_TRIGGERS}
    return frozenset(s for s in states if s not in has_exit)


JOB_TERMINAL: Final = _terminal(JobStatus, JOB_TRANSITIONS)
RUN_TERMINAL: Final = _terminal(RunStatus, RUN_TRANSITIONS)
RESERVATION_TERMINAL: Final = _terminal(ReservationStatus, RESERVATION_TRANSITIONS)
RUN_ACTIVE: Final = frozenset(set(RunStatus) - RUN_TERMINAL)
RESERVATION_ACTIVE: Final = frozenset(set(ReservationStatus) - RESERVATION_TERMINAL)
"""Reservations that hold GPUs (capacity is not offered): live ones and QUARANTINED ones."""
RESERVATION_LIVE: Final = frozenset({ReservationStatus.RESERVED, ReservationStatus.CONFIRMED})
"""Reservations that belong to a job's current attempt (QUARANTINED ones belong to nobody)."""
NODE_PLACEABLE: Final = frozenset({NodeStatus.HEALTHY})


def check_transition(machine: Machine, frm: str, to: str) -> str:
    """Return the trigger name of the edge ``frm -> to`` of ``machine``.

    Raises:
        IllegalTransition: the table has no such edge.
    """
    trigger = TABLES[machine].get((frm, to))
    if trigger is None:
        raise IllegalTransition(f"{machine.value}: {frm} -> {to} is not a legal transition")
    return trigger
