"""Fencing (seed DD3): a node's active attempts revoked in one transaction, their GPUs held
QUARANTINED until the node's agent reports the runs gone (or an operator confirms the node
dead), their jobs moved on (re-placed elsewhere, or ended).

Used by the failure detector (``node_upkeep.fence_silent_nodes``), registration and identity
(an agent that lost its state: ``fence_lost_agent_state``; a rejoin tells a lost state from a
kept one with ``kept_state_problem``), heartbeats (fenced runs reported gone:
``release_gone_quarantined``) and the operator (``node_admin.operator_fence``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from gpufleet.domain.errors import NotFound
from gpufleet.domain.states import (
    RUN_ACTIVE,
    JobStatus,
    Machine,
    NodeStatus,
    ReservationStatus,
    RunStatus,
)
from gpufleet.domain.types import GPU_MILLI
from gpufleet.services import runs
from gpufleet.services.node_health import back_to_healthy
from gpufleet.store import allocate, leader
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, ReservationRow
from gpufleet.store.transitions import record_event, transition


@dataclass(frozen=True, slots=True)
class Fenced:
    """One attempt fenced: its job's next status (None: the job had already moved on)."""

    run_id: str
    job_id: str
    job_status: str | None


def fence_node(
    session: Session,
    node_id: str,
    *,
    reason: str,
    max_node_failures: int,
    node_to: NodeStatus | None = None,
    leader_holder: str | None = None,
    leader_epoch: int | None = None,
    keep: Collection[str] = (),
) -> list[Fenced]:
    """Fence every active attempt of ``node_id`` (but those in ``keep``) in this one
    transaction.

    Each attempt -> FENCED (its token is revoked: the job moves on, and a report or confirm
    under that token is STALE), its reservation -> QUARANTINED (the GPUs are not offered
    again until the agent reports the run gone or an operator confirms the node dead), and
    its job: CANCELLED if a cancel was asked, PENDING if it was being preempted, FAILED if it
    was being stopped for its max runtime, else PENDING for a new attempt elsewhere while it
    has lost at most ``max_node_failures`` attempts to nodes (node losses never consume
    ``max_retries``), FAILED after that. The team is charged the GPU-time up to now.

    Args:
        node_to: the node's new status (e.g. QUARANTINED), or None to leave it.
        leader_holder, leader_epoch: when given, checked against the lease in this
            transaction (the failure detector); an operator's fence passes None.
        keep: run ids left as they are (attempts a rejoining agent still holds).

    Raises:
        NotLeader: the lease moved on.
        NotFound: no such node.
    """
    now = db_now(session)
    if leader_holder is not None and leader_epoch is not None:
        leader.assert_leader(session, leader_holder, leader_epoch, now)
    node = session.get(NodeRow, node_id, with_for_update=True)
    if node is None:
        raise NotFound(f"no node {node_id!r}", field="node_id")
    out: list[Fenced] = []
    active = session.scalars(
        select(JobRunRow)
        .where(JobRunRow.node_id == node_id, JobRunRow.status.in_(sorted(RUN_ACTIVE)))
        .order_by(JobRunRow.id)
    ).all()
    for run in active:
        if run.id in keep:
            continue
        job = session.get(JobRow, run.job_id, with_for_update=True)
        assert job is not None
        transition(
            session,
            Machine.RUN,
            run.id,
            RunStatus.FENCED,
            now=now,
            frm=[run.status],
            guard={"token": run.token},
            values={"finished_at": now, "message": f"fenced: {reason}", "charged_to": "node"},
            job_id=job.id,
            run_id=run.id,
            node_id=node_id,
            message=reason,
        )
        res = session.execute(
            select(ReservationRow).where(ReservationRow.run_id == run.id).with_for_update()
        ).scalar_one_or_none()
        if res is not None and res.status in (
            ReservationStatus.RESERVED,
            ReservationStatus.CONFIRMED,
        ):
            transition(
                session,
                Machine.RESERVATION,
                res.id,
                ReservationStatus.QUARANTINED,
                now=now,
                frm=[res.status],
                job_id=job.id,
                run_id=run.id,
                node_id=node_id,
                message=reason,
            )
            held = res.gpu_milli / GPU_MILLI if res.gpu_milli else res.gpu_count  # a share
            runs.charge_usage(
                session, job.team_id, held, reserved_at=run.created_at, released_at=now
            )
        current = runs.is_current(job, run)
        job_to = _job_after_fence(session, job, run, max_node_failures) if current else None
        if job_to is not None and run.gang_size > 1:
            # a gang member: the attempt's other members are stopped (verified) first; the
            # job moves when the last of them ends (runs.finish_gang_if_done)
            cause = runs.gang_cause(session, run, job_to[0])
            if cause:
                session.execute(update(JobRunRow).where(JobRunRow.id == run.id).values(**cause))
            runs.stop_gang(
                session,
                job.id,
                run.token,
                cause_run_id=run.id,
                message=f"rank {run.rank}'s node was fenced ({reason}); stopping the gang",
            )
            runs.finish_gang_if_done(session, job, run.token, now)
            session.refresh(job)
            out.append(Fenced(run.id, job.id, JobStatus(job.status)))
            continue
        if job_to is not None:
            to, why = job_to
            values: dict[str, object] = {"pending_reason": None}
            if to != JobStatus.PENDING:
                values.update(finished_at=now, failure_reason=None if to == "CANCELLED" else why)
            transition(
                session,
                Machine.JOB,
                job.id,
                to,
                now=now,
                frm=[job.status],
                guard={"fencing_epoch": run.token},
                values=values,
                job_id=job.id,
                run_id=run.id,
                node_id=node_id,
                message=why,
            )
        out.append(Fenced(run.id, job.id, job_to[0] if job_to else None))
    if node_to is not None and node.status != node_to:
        transition(
            session,
            Machine.NODE,
            node_id,
            node_to,
            now=now,
            frm=[node.status],
            values={"status_reason": reason},
            node_id=node_id,
            message=f"{reason}; {len(out)} attempt(s) fenced",
        )
    record_event(
        session,
        "fence",
        now=now,
        node_id=node_id,
        message=f"{reason}: fenced {len(out)} attempt(s)",
        details={"runs": [f.run_id for f in out]},
    )
    return out


def _job_after_fence(
    session: Session, job: JobRow, run: JobRunRow, max_node_failures: int
) -> tuple[JobStatus, str] | None:
    if job.status not in (JobStatus.SCHEDULED, JobStatus.RUNNING):
        return None
    if run.stop_reason == "cancel" or job.cancel_requested:
        return JobStatus.CANCELLED, "cancelled; its node was fenced"
    if run.stop_reason in ("preempt", "requeue"):
        what = "preempted" if run.stop_reason == "preempt" else "requeue requested"
        return JobStatus.PENDING, f"{what}; its node was fenced; requeued"
    if run.stop_reason == "timeout":
        return JobStatus.FAILED, "TIMEOUT: ran past max_runtime_s (its node was then fenced)"
    session.flush()
    lost = session.execute(
        select(func.count())
        .select_from(JobRunRow)
        .where(JobRunRow.job_id == job.id, JobRunRow.charged_to == "node")
    ).scalar_one()
    if lost <= max_node_failures:
        return JobStatus.PENDING, (
            f"its node {run.node_id} was lost ({lost} of {max_node_failures} node losses);"
            " requeued for a new attempt elsewhere (no user retry used)"
        )
    return JobStatus.FAILED, f"lost {lost} attempts to failed nodes (max_node_failures)"


def release_gone_quarantined(
    session: Session,
    node_id: str,
    still_known: set[str] | None,
    *,
    message: str,
    released: list[tuple[str, str, int]] | None = None,
) -> float:
    """Release the QUARANTINED reservations of ``node_id`` whose runs the agent does not list
    (``still_known``; None = release all: an operator confirmed the node dead, -> EXPIRED).
    A QUARANTINED node with none left becomes HEALTHY. Returns the GPUs returned (a share
    counts its fraction); appends
    ``(run_id, job_id, token)`` of each released run to ``released`` when given."""
    now = db_now(session)
    held = session.execute(
        select(ReservationRow.run_id, ReservationRow.job_id, ReservationRow.token).where(
            ReservationRow.node_id == node_id,
            ReservationRow.status == ReservationStatus.QUARANTINED,
        )
    ).all()
    back: float = 0
    left = 0
    for run_id, job_id, token in held:
        if still_known is not None and run_id in still_known:
            left += 1
            continue
        if released is not None:
            released.append((run_id, job_id, int(token)))
        back += allocate.release(
            session,
            run_id=run_id,
            now=now,
            to=ReservationStatus.EXPIRED if still_known is None else ReservationStatus.RELEASED,
            message=message,
            only_quarantined=True,
        )
    if still_known is not None and left == 0:
        node = session.get(NodeRow, node_id)
        if node is not None and node.status == NodeStatus.QUARANTINED:
            back_to_healthy(
                session,
                node_id,
                frm=NodeStatus.QUARANTINED,
                now=now,
                message="the agent is back and its fenced runs are gone",
            )
    return back


def fence_lost_agent_state(
    session: Session,
    node: NodeRow,
    *,
    reason: str,
    max_node_failures: int = 3,
    keep: Collection[str] = (),
) -> None:
    """The node's agent lost its state (re-installed, wiped state dir, rejoined with a new
    certificate and no state): it cannot know the attempts the database gave this node, so
    they are fenced at once (jobs re-placed with a higher token; GPUs QUARANTINED until the
    fresh agent's heartbeats list none of them, or an operator fences the node). ``keep``:
    run ids the agent still holds (a rejoin with its state kept, :func:`kept_state_problem`),
    left as they are; the node is QUARANTINED only when some other attempt is fenced."""
    fenced_any = any(
        run_id not in keep
        for run_id in session.scalars(
            select(JobRunRow.id).where(
                JobRunRow.node_id == node.id, JobRunRow.status.in_(sorted(RUN_ACTIVE))
            )
        )
    )
    fence_node(
        session,
        node.id,
        reason=reason,
        max_node_failures=max_node_failures,
        node_to=NodeStatus.QUARANTINED
        if fenced_any
        and node.status in (NodeStatus.HEALTHY, NodeStatus.SUSPECT, NodeStatus.UNHEALTHY)
        else None,
        keep=keep,
    )
    session.refresh(node)


@dataclass(frozen=True, slots=True)
class KeptState:
    """A rejoin's verdict (:func:`kept_state_problem`): the attempts the agent still holds
    (kept as they are), why the node's other active attempts are fenced (None: none is), and
    whether the agent's state is lost (a re-install: its agent epoch counter starts again)."""

    keep: frozenset[str]
    problem: str | None
    lost: bool = False


def kept_state_problem(
    *,
    agent_epoch: int,
    known_epoch: int,
    held: Mapping[str, int],
    active: Mapping[str, int],
) -> KeptState:
    """Tell a rejoin from a re-install. Pure.

    A node whose certificate expired while its agent was stopped rejoins with a join token;
    its state dir (and its running attempts' shims) may be intact. The agent says what its
    state dir holds: ``agent_epoch`` (the epoch there; 0 = none, a new or wiped state dir, or
    an agent too old to say) and ``held`` (run_id -> token of the attempts its assignment log
    has not seen reported). ``known_epoch``: the node's agent epoch in the database;
    ``active``: run_id -> token of the node's active attempts.

    - no agent epoch, or one below the known epoch (an older copy of the state dir): the
      state is lost, every active attempt is fenced (as for a re-install);
    - otherwise each active attempt the agent holds under the same token is kept; the
      others (an AssignJob that never reached the agent, an older token) are fenced.
    """
    if agent_epoch <= 0:
        return KeptState(
            frozenset(),
            "node rejoined with a new certificate and no agent state (re-installed or wiped"
            " state dir)",
            lost=True,
        )
    if agent_epoch < known_epoch:
        return KeptState(
            frozenset(),
            f"node rejoined with a new certificate and an older agent state (agent epoch"
            f" {agent_epoch} < known {known_epoch}: a restored or copied state dir)",
            lost=True,
        )
    keep = frozenset(r for r, token in active.items() if held.get(r) == token)
    if len(keep) == len(active):
        return KeptState(keep, None)
    return KeptState(
        keep,
        f"node rejoined with a new certificate; its agent (state kept, agent epoch"
        f" {agent_epoch}) does not hold this attempt",
    )
