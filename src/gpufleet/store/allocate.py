"""THE allocation transaction (seed DD1) and its inverse. No dialect branches here.

reserve(): in the caller's write transaction, in this order (lock order: capacity row, GPU
rows, job row), any 0-row step raising so that the whole transaction rolls back:
  1. leader check: (holder, epoch) must hold an unexpired lease;
  2. ``UPDATE node_capacity SET available = available - n, version = version + 1
     WHERE node_id = :id AND available >= n AND <node HEALTHY>``  (0 rows: CapacityConflict);
  3. claim GPU ids: ``UPDATE node_gpus SET holder_run_id = :run WHERE ... AND holder IS NULL``,
     rowcount must equal n (on SQLite steps 2 and 3 are this one UPDATE, guarded by step 2's
     checks and by n free GPU rows, the capacity row following it by a trigger, migration
     0007a: ``dialect.capacity_follows_gpu_rows``);
  4. the job PENDING -> SCHEDULED with ``fencing_epoch = fencing_epoch + 1`` (the new token),
     guarded by the epoch the caller saw and ``cancel_requested = false``;
  5. insert the JobRun (ASSIGNED) and the Reservation (RESERVED, lease, token, leader epoch).

release(): capacity comes back only here, only for an active reservation, and only when the
caller has the agent's word that the processes are gone (or an operator's fence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any, cast

from sqlalchemy import (
    Integer,
    String,
    Table,
    bindparam,
    case,
    delete,
    exists,
    func,
    select,
    update,
)
from sqlalchemy.orm import Session

from gpufleet.domain.errors import CapacityConflict, Conflict, NotLeader, StaleState
from gpufleet.domain.ids import new_reservation_id, new_run_id
from gpufleet.domain.states import (
    RESERVATION_ACTIVE,
    JobStatus,
    Machine,
    NodeStatus,
    ReservationStatus,
    RunStatus,
    check_transition,
)
from gpufleet.domain.types import GPU_MILLI, SHARED_GPU_HOLDER, GpuDevice
from gpufleet.store import leader, reserve_once
from gpufleet.store.db import Database
from gpufleet.store.dialect import (
    as_utc,
    capacity_follows_gpu_rows,
    dml_in_cte,
    execute_all,
    now_sql_for,
    statements_with,
)
from gpufleet.store.outbox import queue_insert
from gpufleet.store.tables import (
    GpuHoldRow,
    JobRunRow,
    LeaderLeaseRow,
    NodeCapacityRow,
    NodeGpuRow,
    NodeRow,
    ReservationRow,
)
from gpufleet.store.transitions import record_transition, transition


@dataclass(frozen=True, slots=True)
class Reserved:
    """The outcome of one successful reserve(): ids, the new fencing token and the GPU ids."""

    job_id: str
    run_id: str
    reservation_id: str
    node_id: str
    token: int
    attempt: int
    gpu_ids: tuple[int, ...]


def reserve(
    session: Session,
    *,
    job_id: str,
    node_id: str,
    gpu_count: int,
    seen_fencing_epoch: int,
    leader_holder: str,
    leader_epoch: int,
    lease_s: float,
    now: datetime | None = None,
    holds: bool = True,
    priority: str | None = None,
    gpu_milli: int = 0,
) -> Reserved:
    """Reserve ``gpu_count`` GPUs of ``node_id`` for a new attempt of ``job_id``; with
    ``gpu_milli`` (> 0; ``gpu_count`` is then 1) a share of one GPU instead: ``gpu_milli``
    thousandths of the fullest GPU of the node that has room (else of its lowest free GPU),
    :func:`_take_share`.

    ``holds``: the job may have GPU holds (``gpu_holds`` rows), deleted here; False (the
    caller's snapshot showed none, and only the leader creates them) saves that statement.
    ``priority``: the class the attempt runs at when a team limit demoted it
    (``job_runs.priority``); None: its job's.

    Raises:
        NotLeader: the caller's (holder, epoch) no longer holds the lease.
        CapacityConflict: the node lacks the free GPUs now, or is not HEALTHY.
        StaleState: the job is no longer PENDING at ``seen_fencing_epoch`` (or was cancelled).
    """
    # a single-node attempt is a gang of one: one reserve path, one job guard, one writer
    return reserve_gang(
        session,
        job_id=job_id,
        members=[(0, node_id, gpu_count)],
        seen_fencing_epoch=seen_fencing_epoch,
        leader_holder=leader_holder,
        leader_epoch=leader_epoch,
        lease_s=lease_s,
        now=now,
        holds=holds,
        priority=priority,
        gpu_milli=gpu_milli,
    ).members[0]


def place(
    db: Database,
    *,
    job_id: str,
    node_id: str,
    gpu_count: int,
    seen_fencing_epoch: int,
    leader_holder: str,
    leader_epoch: int,
    lease_s: float,
    holds: bool = True,
    priority: str | None = None,
    gpu_milli: int = 0,
) -> Reserved:
    """:func:`reserve` as the scheduler applies a placement: in a transaction of its own. Where
    the database runs INSERT/UPDATE inside WITH (PostgreSQL), ONE statement in autocommit,
    one round trip (``store.reserve_once``: the same locks, guards, rows and event); else
    ``db.run_write(reserve)``. A capacity conflict found by the one statement is decided
    again by the transaction of several statements (its snapshot may predate a release that
    committed while it waited for the node's rows).

    Raises:
        NotLeader, CapacityConflict, StaleState: as :func:`reserve`.
    """
    in_tx = partial(
        reserve,
        job_id=job_id,
        node_id=node_id,
        gpu_count=gpu_count,
        seen_fencing_epoch=seen_fencing_epoch,
        leader_holder=leader_holder,
        leader_epoch=leader_epoch,
        lease_s=lease_s,
        holds=holds,
        priority=priority,
        gpu_milli=gpu_milli,
    )
    if gpu_milli or not dml_in_cte(db.engine.dialect.name):
        return db.run_write(in_tx)  # (a share: the transaction of several statements)
    run_id, reservation_id, token = new_run_id(), new_reservation_id(), seen_fencing_epoch + 1
    row = db.run_statement(
        reserve_once.STATEMENTS[holds],
        {
            "p_job": job_id,
            "p_node": node_id,
            "p_n": gpu_count,
            "p_run": run_id,
            "p_res": reservation_id,
            "p_seen": seen_fencing_epoch,
            "p_token": token,
            "p_holder": leader_holder,
            "p_epoch": leader_epoch,
            "p_lease_name": leader.LEASE_NAME,
            "p_lease_s": float(lease_s),
            "p_head": f"reserved {gpu_count} GPU(s) [",
            "p_tail": f"] on {node_id}, token {token}",
            "p_prio": priority,
        },
    )
    assert row is not None
    if not row.lease_ok:
        raise NotLeader(f"not leader at epoch {leader_epoch} (holder {leader_holder})")
    if not row.job_ok:
        raise StaleState(
            f"job {job_id}: not PENDING at fencing epoch {seen_fencing_epoch}"
            " (or cancel requested, or held)"
        )
    if row.now is None:
        return db.run_write(in_tx)  # a real conflict raises CapacityConflict there
    gpu_ids = tuple(int(g) for g in row.gpu_ids)
    return Reserved(job_id, run_id, reservation_id, node_id, token, token, gpu_ids)


def _job_guard(seen_fencing_epoch: int) -> dict[str, object]:
    """What a reservation requires of the job row (single node and gang alike): the fencing
    epoch the pass saw, no cancel requested, and not held (a hold that landed after the pass's
    snapshot wins over its placement)."""
    return {"fencing_epoch": seen_fencing_epoch, "cancel_requested": False, "held": False}


def _add_member(
    session: Session,
    job_id: str,
    attempt: int,
    token: int,
    run_id: str,
    node_id: str,
    gpu_ids: list[int],
    rank: int,
    gang_size: int,
    leader_epoch: int,
    lease_s: float,
    now: datetime,
    priority: str | None = None,
    gpu_milli: int = 0,
) -> Reserved:
    """The run row and the reservation row of one member of an attempt (a single-node attempt
    is rank 0 of 1), under the attempt's fencing ``token``; the GPUs are already claimed."""
    reservation_id = new_reservation_id()
    # queued (store.outbox): written at commit, the run rows before the reservation rows, with
    # the transaction's events; on PostgreSQL all of them in one statement
    queue_insert(
        session,
        JobRunRow.__table__,
        {
            "id": run_id,
            "job_id": job_id,
            "attempt": attempt,
            "node_id": node_id,
            "status": RunStatus.ASSIGNED,
            "token": token,
            "gpu_ids": gpu_ids,
            "rank": rank,
            "gang_size": gang_size,
            "created_at": now,
            "priority": priority,
        },
    )
    queue_insert(
        session,
        ReservationRow.__table__,
        {
            "id": reservation_id,
            "run_id": run_id,
            "job_id": job_id,
            "node_id": node_id,
            "gpu_ids": gpu_ids,
            "gpu_count": 0 if gpu_milli else len(gpu_ids),
            "gpu_milli": gpu_milli,
            "status": ReservationStatus.RESERVED,
            "token": token,
            "leader_epoch": leader_epoch,
            "lease_expires_at": now + timedelta(seconds=lease_s),
            "created_at": now,
        },
    )
    return Reserved(job_id, run_id, reservation_id, node_id, token, attempt, tuple(gpu_ids))


_TAKE: dict[tuple[str, bool], tuple[Any | None, Any]] = {}


def _lease_still_held(dialect: str) -> Any:
    """The condition that the leader lease is still ``p_holder``'s at ``p_epoch`` and
    unexpired by the database clock, read-locked (FOR SHARE on PostgreSQL) so that a
    takeover waits for the reservation's transaction."""
    lease_row = LeaderLeaseRow.__table__.c
    return exists(
        select(lease_row.name)
        .where(
            lease_row.name == leader.LEASE_NAME,
            lease_row.holder == bindparam("p_holder", type_=String),
            lease_row.epoch == bindparam("p_epoch", type_=Integer),
            lease_row.expires_at > now_sql_for(dialect),
        )
        .with_for_update(read=True)
    )


def _take_statements(dialect: str, with_lease: bool) -> tuple[Any | None, Any]:
    """The statements of :func:`_take_gpus` (the capacity update, None where the capacity
    follows the GPU rows by itself, and the GPU claim), built once per (dialect, lease check)
    with bind parameters ``p_node``, ``p_n``, ``p_run`` (and ``p_holder``, ``p_epoch``): no
    statement construction or cache-key generation per reservation (SQLAlchemy memoizes the
    key of a statement object it has seen)."""
    key = (dialect, with_lease)
    hit = _TAKE.get(key)
    if hit is not None:
        return hit
    cap = NodeCapacityRow.__table__.c
    gpu = NodeGpuRow.__table__.c
    node, n = bindparam("p_node", type_=String), bindparam("p_n", type_=Integer)
    conds = [
        cap.node_id == node,
        cap.available_gpus >= n,
        exists().where(NodeRow.id == node, NodeRow.status == NodeStatus.HEALTHY),
    ]
    now = now_sql_for(dialect)
    if with_lease:
        conds.append(_lease_still_held(dialect))
    free = (
        select(gpu.gpu_index)
        .where(gpu.node_id == node, gpu.holder_run_id.is_(None))
        .order_by(gpu.gpu_index)
        .limit(n)
        .scalar_subquery()
    )
    claim = update(cast(Table, NodeGpuRow.__table__)).values(
        holder_run_id=bindparam("p_run", type_=String)
    )
    if capacity_follows_gpu_rows(dialect):
        # ONE statement: the capacity row moves with the GPU rows (trigger, migration 0007a);
        # every check of the capacity update is a guard of the claim, and the claim happens
        # only when n GPU rows are free, so it claims n rows or none (the uncorrelated
        # subqueries are evaluated once, before any row changes)
        free_now = (
            select(func.count())
            .select_from(NodeGpuRow.__table__)
            .where(gpu.node_id == node, gpu.holder_run_id.is_(None))
            .scalar_subquery()
        )
        claim = claim.where(
            gpu.node_id == node,
            gpu.gpu_index.in_(free),
            gpu.holder_run_id.is_(None),
            free_now >= n,
            exists().where(*conds),
        ).returning(gpu.gpu_index, now)
        _TAKE[key] = (None, claim)
        return None, claim
    take = (
        update(cast(Table, NodeCapacityRow.__table__))
        .where(*conds)
        .values(available_gpus=cap.available_gpus - n, version=cap.version + 1)
        .returning(now)
    )
    claim = claim.where(
        gpu.node_id == node, gpu.gpu_index.in_(free), gpu.holder_run_id.is_(None)
    ).returning(gpu.gpu_index)
    _TAKE[key] = (take, claim)
    return take, claim


def _take_gpus(
    session: Session,
    node_id: str,
    gpu_count: int,
    run_id: str,
    lease: tuple[str, int] | None = None,
) -> tuple[list[int], datetime | None]:
    """Steps 2 and 3 of reserve() on one node: the conditional capacity update, then the
    GPU rows claimed for ``run_id``, two statements; one where the capacity follows the GPU
    rows (SQLite, ``dialect.capacity_follows_gpu_rows``): the claim guarded by every check of
    the capacity update. Returns the claimed GPU indexes, and with ``lease`` the database
    clock of the capacity update.

    ``lease``: ``(holder, epoch)`` to check in the capacity update itself (step 1 folded
    into step 2): it matches only while that lease is unexpired on the database clock, and
    on PostgreSQL share-locks the lease row until commit, as ``leader.assert_leader`` does.

    Raises:
        NotLeader: with ``lease``, the lease is not held (checked only when no row matched).
        CapacityConflict: the node lacks ``gpu_count`` free GPUs now or is not HEALTHY.
    """
    take, claim = _take_statements(session.get_bind().dialect.name, lease is not None)
    params: dict[str, object] = {"p_node": node_id, "p_n": gpu_count, "p_run": run_id}
    if lease is not None:
        params["p_holder"], params["p_epoch"] = lease
    if take is None:
        got = session.execute(claim, params).all()
        if not got:
            if lease is not None:
                leader.assert_leader(session, lease[0], lease[1])
            raise CapacityConflict(
                f"node {node_id}: fewer than {gpu_count} free GPUs or not HEALTHY"
            )
        if len(got) != gpu_count:  # cannot happen (guarded); never patch it: roll back
            raise CapacityConflict(f"node {node_id}: claimed {len(got)} of {gpu_count} GPUs")
        clock = as_utc(got[0][1]) if lease is not None else None
        return sorted(int(g[0]) for g in got), clock
    took = session.execute(take, params).first()
    if took is None:
        if lease is not None:
            leader.assert_leader(session, lease[0], lease[1])  # raises NotLeader if it is that
        raise CapacityConflict(f"node {node_id}: fewer than {gpu_count} free GPUs or not HEALTHY")
    # the lowest free GPU indexes, claimed in the same statement (the capacity row, locked
    # above until commit, serialises every reserve and release of this node)
    claimed = session.scalars(claim, params).all()
    if len(claimed) != gpu_count:
        # available said yes but the GPU rows disagree: an invariant is broken; never patch it.
        raise CapacityConflict(f"node {node_id}: capacity row and GPU rows disagree")
    return sorted(int(g) for g in claimed), (as_utc(took[0]) if lease is not None else None)


_SHARE: dict[tuple[str, bool], tuple[Any, Any, Any]] = {}


def _share_statements(dialect: str, with_lease: bool) -> tuple[Any, Any, Any]:
    """The statements of :func:`_take_share`, built once per (dialect, lease check), bind
    parameters ``p_node``, ``p_m`` (and ``p_holder``, ``p_epoch``):

    * ``lock``: the node's capacity row (``version + 1``), only while the node is HEALTHY,
      shares GPUs (``gpu_sharing`` not ``none``) and, with the lease, the caller leads;
      returns the database clock. Every reserve and release of the node locks this row, so
      on PostgreSQL the statements after it see every share committed before;
    * ``claim``: ONE guarded UPDATE of one GPU row, the fullest with room (a free GPU, 0,
      comes last: whole GPUs stay whole while a shared one has room): ``shared_milli +
      :m <= 1000`` and a holder that is NULL or the share holder, re-checked by PostgreSQL
      on the row's newest version if a concurrent writer changed it; the schema's CHECKs
      bound it again (migration 0012_frac27). Returns the GPU index and its new sum;
    * ``down``: the capacity's ``available_gpus - 1`` when that was the GPU's first share
      (None where the capacity follows the GPU rows: the SQLite trigger sees the holder
      go from NULL to the share holder)."""
    key = (dialect, with_lease)
    hit = _SHARE.get(key)
    if hit is not None:
        return hit
    cap = NodeCapacityRow.__table__.c
    gpu = NodeGpuRow.__table__.c
    node, m = bindparam("p_node", type_=String), bindparam("p_m", type_=Integer)
    conds = [
        cap.node_id == node,
        exists().where(
            NodeRow.id == node, NodeRow.status == NodeStatus.HEALTHY, NodeRow.gpu_sharing != "none"
        ),
    ]
    now = now_sql_for(dialect)
    if with_lease:
        conds.append(_lease_still_held(dialect))
    lock = (
        update(cast(Table, NodeCapacityRow.__table__))
        .where(*conds)
        .values(version=cap.version + 1)
        .returning(now)
    )
    room = [
        gpu.node_id == node,
        (gpu.holder_run_id.is_(None)) | (gpu.holder_run_id == SHARED_GPU_HOLDER),
        gpu.shared_milli + m <= GPU_MILLI,
    ]
    fullest = (
        select(gpu.gpu_index)
        .where(*room)
        .order_by(gpu.shared_milli.desc(), gpu.gpu_index)
        .limit(1)
        .scalar_subquery()
    )
    claim = (
        update(cast(Table, NodeGpuRow.__table__))
        .where(gpu.gpu_index == fullest, *room)
        .values(shared_milli=gpu.shared_milli + m, holder_run_id=SHARED_GPU_HOLDER)
        .returning(gpu.gpu_index, gpu.shared_milli)
    )
    down = None
    if not capacity_follows_gpu_rows(dialect):
        down = (
            update(cast(Table, NodeCapacityRow.__table__))
            .where(cap.node_id == node, cap.available_gpus >= 1)
            .values(available_gpus=cap.available_gpus - 1)
        )
    _SHARE[key] = (lock, claim, down)
    return lock, claim, down


def _take_share(
    session: Session, node_id: str, gpu_milli: int, lease: tuple[str, int] | None = None
) -> tuple[list[int], datetime | None]:
    """Steps 2 and 3 of reserve() for a share: ``gpu_milli`` thousandths of one GPU of
    ``node_id`` (:func:`_share_statements`: the capacity row locked, one guarded UPDATE of
    the fullest GPU row with room, the capacity moved when that GPU was free). Returns
    ``[gpu_index]`` and with ``lease`` the database clock.

    Raises:
        NotLeader: with ``lease``, the lease is not held.
        CapacityConflict: the node is not HEALTHY, does not share GPUs, or no GPU of it has
            room for the share now.
    """
    lock, claim, down = _share_statements(session.get_bind().dialect.name, lease is not None)
    params: dict[str, object] = {"p_node": node_id, "p_m": gpu_milli}
    if lease is not None:
        params["p_holder"], params["p_epoch"] = lease
    locked = session.execute(lock, params).first()
    if locked is None:
        if lease is not None:
            leader.assert_leader(session, lease[0], lease[1])
        raise CapacityConflict(f"node {node_id}: not HEALTHY, or its GPUs are not shared")
    got = session.execute(claim, params).first()
    if got is None:
        raise CapacityConflict(
            f"node {node_id}: no GPU has room for {gpu_milli / GPU_MILLI:g} of a GPU"
        )
    index, total = int(got[0]), int(got[1])
    first = down is not None and total == gpu_milli  # its first share: no longer a free GPU
    if first and session.execute(down, params).rowcount != 1:  # type: ignore[attr-defined]
        raise CapacityConflict(f"node {node_id}: capacity row and GPU rows disagree")
    return [index], (as_utc(locked[0]) if lease is not None else None)


@dataclass(frozen=True, slots=True)
class ReservedGang:
    """The outcome of one successful reserve_gang(): one :class:`Reserved` per member, in
    rank order, all with the same token and attempt number."""

    job_id: str
    token: int
    attempt: int
    members: tuple[Reserved, ...]


def reserve_gang(
    session: Session,
    *,
    job_id: str,
    members: Sequence[tuple[int, str, int]],
    seen_fencing_epoch: int,
    leader_holder: str,
    leader_epoch: int,
    lease_s: float,
    now: datetime | None = None,
    holds: bool = True,
    priority: str | None = None,
    gpu_milli: int = 0,
) -> ReservedGang:
    """Reserve every member of a gang attempt of ``job_id``, or none: one transaction.

    ``members``: ``(rank, node_id, gpu_count)`` per member; ranks are 0..n-1 and the nodes
    distinct. The capacity and GPU rows are updated in node-id order whatever the ranks,
    so two schedulers reserving overlapping gangs lock rows in the same order and never
    deadlock (PostgreSQL); on SQLite ``BEGIN IMMEDIATE`` serialises writers anyway. Any
    member that does not fit raises, and the caller's transaction rolls back every member.
    Every member gets its own JobRun (rank, gang_size) and Reservation under ONE new token;
    the job's ``current_run_id`` is rank 0's run. ``holds``: as for :func:`reserve`.
    ``gpu_milli``: a share of one GPU (one member of one GPU only), :func:`_take_share`.

    Raises:
        NotLeader: the caller's (holder, epoch) no longer holds the lease.
        CapacityConflict: a member's node lacks the free GPUs now, or is not HEALTHY.
        StaleState: the job is no longer PENDING at ``seen_fencing_epoch`` (or was cancelled).
        ValueError: the ranks are not 0..n-1, or two members share a node.
    """
    size = len(members)
    if sorted(m[0] for m in members) != list(range(size)) or size < 1:
        raise ValueError(f"gang ranks must be 0..{size - 1}: {[m[0] for m in members]}")
    if len({m[1] for m in members}) != size:
        raise ValueError("two members of a gang on one node")
    if gpu_milli and (size != 1 or members[0][2] != 1 or not 0 < gpu_milli < GPU_MILLI):
        raise ValueError(f"a share ({gpu_milli}/1000) is of one GPU of one node")
    run_ids = {rank: new_run_id() for rank, _, _ in members}
    gpus: dict[int, list[int]] = {}
    lease: tuple[str, int] | None = (leader_holder, leader_epoch)
    for rank, node_id, count in sorted(members, key=lambda m: m[1]):  # lock order: node id
        # the first capacity update also checks the lease and reads the database clock
        if gpu_milli:
            gpus[rank], clock = _take_share(session, node_id, gpu_milli, lease)
        else:
            gpus[rank], clock = _take_gpus(session, node_id, count, run_ids[rank], lease)
        if lease is not None:
            now, lease = (now if now is not None else clock), None
    assert now is not None
    token = seen_fencing_epoch + 1
    # attempts and fencing_epoch move together (both +1 here, and only here), and the job
    # guard pins fencing_epoch to what the caller saw: the new attempt's number is the token
    attempt = token
    by_rank = sorted(members)
    if gpu_milli:
        message = (
            f"reserved {gpu_milli / GPU_MILLI:g} of GPU {gpus[0]} on {by_rank[0][1]} (shared),"
            f" token {token}"
        )
    elif size == 1:
        message = f"reserved {by_rank[0][2]} GPU(s) {gpus[0]} on {by_rank[0][1]}, token {token}"
    else:
        placed = ", ".join(f"rank {r}: {c} GPU(s) {gpus[r]} on {n}" for r, n, c in by_rank)
        message = f"reserved a gang of {size} ({placed}), token {token}"
    transition(
        session,
        Machine.JOB,
        job_id,
        JobStatus.SCHEDULED,
        now=now,
        frm=[JobStatus.PENDING],
        guard=_job_guard(seen_fencing_epoch),
        values={
            "fencing_epoch": token,
            "current_run_id": run_ids[0],
            "attempts": attempt,
            "scheduled_at": now,
            "pending_reason": None,
        },
        message=message,
        job_id=job_id,
        run_id=run_ids[0],
        node_id=by_rank[0][1],
    )
    if holds:
        session.execute(delete(GpuHoldRow).where(GpuHoldRow.job_id == job_id))
    out = [
        _add_member(
            session,
            job_id,
            attempt,
            token,
            run_ids[rank],
            node_id,
            gpus[rank],
            rank,
            size,
            leader_epoch,
            lease_s,
            now,
            priority,
            gpu_milli,
        )
        for rank, node_id, _count in by_rank
    ]
    return ReservedGang(job_id, token, attempt, tuple(out))


@dataclass(frozen=True, slots=True)
class ActiveReservation:
    """A run's active reservation as a caller read it (see :func:`release`)."""

    id: str
    job_id: str
    node_id: str
    gpu_count: int
    status: str


_RELEASE: dict[tuple[str, bool], tuple[Any, list[Any]]] = {}


def _release_statements(dialect: str, only_quarantined: bool) -> tuple[Any, list[Any]]:
    """:func:`release`'s statements, built once per (dialect, states) with bind parameters
    ``p_run``, ``p_node``, ``p_n`` (as :func:`_take_statements`): the locking read of the
    run's active reservation with the database clock, and the GPU rows freed with the
    capacity update (one statement on PostgreSQL, two on SQLite; the capacity update last,
    its row count is the answer; on SQLite one: the GPU rows freed, the capacity row
    following them, their row count the answer)."""
    key = (dialect, only_quarantined)
    hit = _RELEASE.get(key)
    if hit is not None:
        return hit
    states = [ReservationStatus.QUARANTINED] if only_quarantined else sorted(RESERVATION_ACTIVE)
    res_c = ReservationRow.__table__.c
    cap = NodeCapacityRow.__table__.c
    gpu = NodeGpuRow.__table__.c
    run, node = bindparam("p_run", type_=String), bindparam("p_node", type_=String)
    n = bindparam("p_n", type_=Integer)
    lock = (
        select(
            res_c.id,
            res_c.job_id,
            res_c.node_id,
            res_c.gpu_count,
            res_c.status,
            now_sql_for(dialect),
        )
        .where(res_c.run_id == run, res_c.status.in_(states))
        .with_for_update()
    )
    free = (
        update(cast(Table, NodeGpuRow.__table__))
        .where(gpu.node_id == node, gpu.holder_run_id == run)
        .values(holder_run_id=None)
    )
    give_back = (
        [free]  # the capacity row follows (trigger, migration 0007a)
        if capacity_follows_gpu_rows(dialect)
        else statements_with(
            dialect,
            update(cast(Table, NodeCapacityRow.__table__))
            .where(cap.node_id == node, cap.available_gpus + n <= cap.total_gpus)
            .values(available_gpus=cap.available_gpus + n, version=cap.version + 1),
            free,
        )
    )
    _RELEASE[key] = (lock, give_back)
    return lock, give_back


def release(
    session: Session,
    *,
    run_id: str,
    now: datetime | None,
    to: ReservationStatus = ReservationStatus.RELEASED,
    message: str,
    only_quarantined: bool = False,
    known: ActiveReservation | None = None,
) -> float:
    """Release the active reservation of ``run_id`` (RESERVED, CONFIRMED or QUARANTINED;
    ``only_quarantined``: only a QUARANTINED one): reservation -> RELEASED (or EXPIRED),
    GPU rows freed, capacity returned. Returns the number of GPUs returned (0 if the run held
    no active reservation: releasing twice is a no-op, not an error).

    Call only with the agent's word that the attempt's processes are gone, or on a fence.
    A share reservation (``gpu_count`` 0) gives its part of its GPU back
    (:func:`_release_share`) and returns that fraction (0.25 for a quarter): what the
    caller charges the team for (GPU-seconds per second held).

    ``known``: the run's active reservation as the caller read it in this transaction (with
    ``now``): it is moved by one UPDATE guarded by that status, without a read first; if it
    moved meanwhile, the reservation is read and locked as without ``known``.
    """
    states = [ReservationStatus.QUARANTINED] if only_quarantined else sorted(RESERVATION_ACTIVE)
    res_c = ReservationRow.__table__.c
    moved = False
    if known is not None and now is not None and known.status in states:
        check_transition(Machine.RESERVATION, known.status, to)
        moved = (
            session.execute(
                update(ReservationRow)
                .where(
                    res_c.id == known.id,
                    res_c.run_id == run_id,
                    res_c.status == known.status,
                )
                .values(status=to, released_at=now)
                .execution_options(synchronize_session=False)
            ).rowcount  # type: ignore[attr-defined]
            == 1
        )
    if moved:
        assert known is not None
        assert now is not None
        res_id, job_id, node_id, gpu_count = known.id, known.job_id, known.node_id, known.gpu_count
        record_transition(
            session,
            Machine.RESERVATION,
            res_id,
            known.status,
            to,
            now=now,
            message=message,
            job_id=job_id,
            run_id=run_id,
            node_id=node_id,
        )
    else:
        # the active reservation, locked, with the database clock (one statement)
        lock, _ = _release_statements(session.get_bind().dialect.name, only_quarantined)
        found = session.execute(lock, {"p_run": run_id}).first()
        if found is None:
            return 0
        res_id, job_id, node_id, gpu_count, was, at = found
        now = now if now is not None else as_utc(at)
        transition(
            session,
            Machine.RESERVATION,
            res_id,
            to,
            now=now,
            frm=[was],
            values={"released_at": now},
            message=message,
            job_id=job_id,
            run_id=run_id,
            node_id=node_id,
        )
    if gpu_count == 0:  # a share reservation (a whole one holds >= 1 GPU)
        return _release_share(session, res_id, node_id, run_id)
    # the run's GPU rows (locked by nobody else: its reservation row is) freed with the
    # capacity update, in one statement on PostgreSQL (dialect.statements_with)
    _, give_back = _release_statements(session.get_bind().dialect.name, only_quarantined)
    params = {"p_node": node_id, "p_n": gpu_count, "p_run": run_id}
    back = execute_all(session, give_back, params)
    if capacity_follows_gpu_rows(session.get_bind().dialect.name):
        # the capacity moved with each GPU row freed (CHECK available <= total bounds it)
        if back.rowcount != gpu_count:
            raise StaleState(
                f"node {node_id}: run {run_id} held {back.rowcount} GPU rows, its"
                f" reservation {gpu_count}"
            )
    elif back.rowcount != 1:
        raise StaleState(f"node {node_id}: returning {gpu_count} GPUs would exceed total")
    return int(gpu_count)


_UNSHARE: dict[str, tuple[Any, Any, Any, Any]] = {}


def _unshare_statements(dialect: str) -> tuple[Any, Any, Any, Any]:
    """:func:`_release_share`'s statements, built once per dialect (bind parameters
    ``p_res``, ``p_node``, ``p_gpu``, ``p_m``): the reservation's share and GPU; the capacity
    row locked (as every reserve and release of the node does); ONE guarded UPDATE taking
    the share off its GPU row (the holder back to NULL with the last share); the capacity's
    ``available_gpus + 1`` when that freed the GPU (None where the capacity follows the GPU
    rows: SQLite's trigger)."""
    hit = _UNSHARE.get(dialect)
    if hit is not None:
        return hit
    res_c = ReservationRow.__table__.c
    cap = NodeCapacityRow.__table__.c
    gpu = NodeGpuRow.__table__.c
    node = bindparam("p_node", type_=String)
    m = bindparam("p_m", type_=Integer)
    share = select(res_c.gpu_milli, res_c.gpu_ids).where(
        res_c.id == bindparam("p_res", type_=String)
    )
    lock = (
        update(cast(Table, NodeCapacityRow.__table__))
        .where(cap.node_id == node)
        .values(version=cap.version + 1)
    )
    last = gpu.shared_milli == m
    take_off = (
        update(cast(Table, NodeGpuRow.__table__))
        .where(
            gpu.node_id == node,
            gpu.gpu_index == bindparam("p_gpu", type_=Integer),
            gpu.holder_run_id == SHARED_GPU_HOLDER,
            gpu.shared_milli >= m,
        )
        .values(
            shared_milli=gpu.shared_milli - m,
            holder_run_id=case((last, None), else_=gpu.holder_run_id),
        )
        .returning(gpu.shared_milli)
    )
    up = None
    if not capacity_follows_gpu_rows(dialect):
        up = (
            update(cast(Table, NodeCapacityRow.__table__))
            .where(cap.node_id == node, cap.available_gpus + 1 <= cap.total_gpus)
            .values(available_gpus=cap.available_gpus + 1)
        )
    _UNSHARE[dialect] = (share, lock, take_off, up)
    return share, lock, take_off, up


def _release_share(session: Session, res_id: str, node_id: str, run_id: str) -> float:
    """Give a share reservation's part of its GPU back (its row already moved out of the
    active states by :func:`release`); with the last share of the GPU, the GPU is a whole
    free GPU again (in ``available_gpus``). Returns the share as a fraction of a GPU.

    Raises:
        StaleState: the GPU row does not hold the share (an invariant is broken; never
            patched: the transaction rolls back).
    """
    share, lock, take_off, up = _unshare_statements(session.get_bind().dialect.name)
    milli, gpu_ids = session.execute(share, {"p_res": res_id}).one()
    params = {"p_node": node_id, "p_gpu": int(gpu_ids[0]), "p_m": int(milli)}
    session.execute(lock, params)
    left = session.execute(take_off, params).first()
    if left is None:
        raise StaleState(
            f"node {node_id}: GPU {gpu_ids[0]} does not hold run {run_id}'s share ({milli}/1000)"
        )
    freed = int(left[0]) == 0
    if freed and up is not None and session.execute(up, params).rowcount != 1:  # type: ignore[attr-defined]
        raise StaleState(f"node {node_id}: returning GPU {gpu_ids[0]} would exceed total")
    return int(milli) / GPU_MILLI


def set_inventory(
    session: Session, node_id: str, gpus: tuple[GpuDevice, ...], *, retype: bool = False
) -> None:
    """Record a node's GPUs: a new node's capacity rows, or a changed inventory of a node that
    holds no reservation (its GPU rows replaced, total = available = len(gpus)). An unchanged
    GPU count is left alone unless ``retype`` (the GPU type changed).

    Raises:
        Conflict: the GPU count or type changed while GPUs of the node are reserved.
    """
    cap = session.get(NodeCapacityRow, node_id, with_for_update=True)
    if cap is not None and cap.total_gpus == len(gpus) and not retype:
        return
    if cap is not None and cap.available_gpus != cap.total_gpus:
        raise Conflict(
            f"node {node_id} now reports {len(gpus)} {gpus[0].gpu_type} GPU(s)"
            f" ({cap.total_gpus} recorded) while GPUs are reserved",
            field="gpus",
        )
    session.execute(delete(NodeGpuRow).where(NodeGpuRow.node_id == node_id))
    for g in gpus:
        session.add(
            NodeGpuRow(
                node_id=node_id,
                gpu_index=g.index,
                uuid=g.uuid,
                gpu_type=g.gpu_type,
                memory_mb=g.memory_mb,
            )
        )
    if cap is None:
        session.add(
            NodeCapacityRow(
                node_id=node_id, total_gpus=len(gpus), available_gpus=len(gpus), version=0
            )
        )
    else:
        cap.total_gpus = cap.available_gpus = len(gpus)
        cap.version += 1


def remove_inventory(session: Session, node_id: str) -> None:
    """Delete a node's capacity, GPU and hold rows (``admin node forget``): it leaves the
    scheduler's view. Its history (attempts, events) stays.

    Raises:
        Conflict: GPUs of the node are reserved (drain it first).
    """
    cap = session.get(NodeCapacityRow, node_id, with_for_update=True)
    active = session.execute(
        select(
            exists().where(
                ReservationRow.node_id == node_id,
                ReservationRow.status.in_(
                    [ReservationStatus.RESERVED, ReservationStatus.CONFIRMED]
                ),
            )
        )
    ).scalar_one()
    if active or (cap is not None and cap.available_gpus != cap.total_gpus):
        raise Conflict(
            f"node {node_id} has reserved GPUs; drain it and wait for its work to end first",
            field="node_id",
        )
    session.execute(delete(GpuHoldRow).where(GpuHoldRow.node_id == node_id))
    session.execute(delete(NodeGpuRow).where(NodeGpuRow.node_id == node_id))
    session.execute(delete(NodeCapacityRow).where(NodeCapacityRow.node_id == node_id))
