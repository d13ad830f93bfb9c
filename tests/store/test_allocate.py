"""The reserve transaction and its inverse, on SQLite and real PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import CapacityConflict, NotLeader, StaleState
from gpufleet.domain.states import JobStatus, NodeStatus
from gpufleet.services.nodes import set_node_status
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import check_database
from gpufleet.store.tables import JobRow, NodeCapacityRow
from tests.factories import become_leader, create_node, create_team, submit


def reserve(
    db: Database,
    job_id: str,
    node_id: str,
    n: int,
    *,
    epoch: int,
    seen: int = 0,
    holder: str = "test-leader",
) -> allocate.Reserved:
    return db.run_write(
        lambda s: allocate.reserve(
            s,
            job_id=job_id,
            node_id=node_id,
            gpu_count=n,
            seen_fencing_epoch=seen,
            leader_holder=holder,
            leader_epoch=epoch,
            lease_s=60,
            now=db_now(s),
        )
    )


def violations(db: Database) -> list[str]:
    return [str(v) for v in check_database(db)[1]]


class TestReserve:
    def test_reserves_gpu_ids_and_moves_the_job(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1", gpus=8)
        epoch = become_leader(db)
        job = submit(db, gpus=3)
        got = reserve(db, job.job_id, "n1", 3, epoch=epoch)
        assert got.gpu_ids == (0, 1, 2)
        assert got.token == 1 and got.attempt == 1
        with db.read() as s:
            assert s.get(NodeCapacityRow, "n1").available_gpus == 5
            row = s.get(JobRow, job.job_id)
            assert (row.status, row.current_run_id, row.fencing_epoch) == (
                "SCHEDULED",
                got.run_id,
                1,
            )
        assert violations(db) == []

    def test_second_job_gets_disjoint_gpus(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1", gpus=8)
        epoch = become_leader(db)
        a = reserve(db, submit(db, gpus=4).job_id, "n1", 4, epoch=epoch)
        b = reserve(db, submit(db, gpus=4).job_id, "n1", 4, epoch=epoch)
        assert set(a.gpu_ids).isdisjoint(b.gpu_ids)
        with pytest.raises(CapacityConflict):
            reserve(db, submit(db, gpus=1).job_id, "n1", 1, epoch=epoch)
        assert violations(db) == []

    def test_conflict_rolls_back_everything(self, db: Database) -> None:
        create_team(db)
        job = submit(db, gpus=4)  # accepted while no node is registered (bound: 8)
        create_node(db, "n1", gpus=2)
        epoch = become_leader(db)
        with pytest.raises(CapacityConflict):
            reserve(db, job.job_id, "n1", 4, epoch=epoch)
        with db.read() as s:
            assert s.get(NodeCapacityRow, "n1").available_gpus == 2
            assert s.get(JobRow, job.job_id).status == JobStatus.PENDING

    def test_stale_leader_epoch_is_rejected_inside_the_transaction(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1")
        epoch = become_leader(db)
        job = submit(db)
        with pytest.raises(NotLeader):
            reserve(db, job.job_id, "n1", 1, epoch=epoch + 1)
        with pytest.raises(NotLeader):
            reserve(db, job.job_id, "n1", 1, epoch=epoch, holder="someone-else")
        with db.read() as s:
            assert s.get(NodeCapacityRow, "n1").available_gpus == 8

    def test_stale_job_epoch_is_rejected(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1")
        epoch = become_leader(db)
        job = submit(db)
        with pytest.raises(StaleState):
            reserve(db, job.job_id, "n1", 1, epoch=epoch, seen=5)

    def test_unhealthy_node_gets_no_reservation(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1")
        epoch = become_leader(db)
        db.run_write(lambda s: set_node_status(s, "n1", NodeStatus.CORDONED, message="test"))
        with pytest.raises(CapacityConflict):
            reserve(db, submit(db).job_id, "n1", 1, epoch=epoch)

    def test_release_returns_capacity_once(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1", gpus=8)
        epoch = become_leader(db)
        got = reserve(db, submit(db, gpus=8).job_id, "n1", 8, epoch=epoch)
        returned = db.run_write(
            lambda s: allocate.release(s, run_id=got.run_id, now=db_now(s), message="t")
        )
        again = db.run_write(
            lambda s: allocate.release(s, run_id=got.run_id, now=db_now(s), message="t")
        )
        assert (returned, again) == (8, 0)
        with db.read() as s:
            assert s.get(NodeCapacityRow, "n1").available_gpus == 8


def test_a_claim_takes_all_its_gpus_or_none_when_capacity_and_gpu_rows_disagree(
    db: Database,
) -> None:
    """Capacity says 8 free while 2 GPU rows are held (a broken invariant, made by hand): a
    reservation of 8 claims no GPU and moves nothing (SQLite: the one guarded UPDATE of the GPU
    rows claims none; PostgreSQL: the capacity update is rolled back with the claim)."""
    from sqlalchemy import update

    from gpufleet.store.tables import NodeGpuRow

    create_team(db)
    create_node(db, "n1", gpus=8)
    epoch = become_leader(db)
    job = submit(db, gpus=8)

    def corrupt(s: Session) -> None:
        s.execute(update(NodeGpuRow).where(NodeGpuRow.gpu_index < 2).values(holder_run_id="r-x"))
        s.execute(update(NodeCapacityRow).values(available_gpus=8))

    db.run_write(corrupt)
    with pytest.raises(CapacityConflict):
        reserve(db, job.job_id, "n1", 8, epoch=epoch)
    with db.read() as s:
        assert s.get(NodeCapacityRow, "n1").available_gpus == 8
        holders = s.scalars(select(NodeGpuRow.holder_run_id).order_by(NodeGpuRow.gpu_index))
        assert list(holders) == ["r-x", "r-x"] + [None] * 6
        assert s.get(JobRow, job.job_id).status == JobStatus.PENDING


def test_sqlite_capacity_follows_the_gpu_rows(db: Database) -> None:
    """SQLite (migration 0007a's trigger): claiming or freeing GPU rows moves the node's free
    count in the same statement, and never past its bounds; PostgreSQL has no trigger (its
    statements move the capacity row themselves)."""
    from sqlalchemy import text, update
    from sqlalchemy.exc import IntegrityError

    from gpufleet.store.tables import NodeGpuRow

    create_node(db, "n1", gpus=4)
    gpus = NodeGpuRow.__table__.c

    def hold(run: str | None, *, where: object) -> None:
        db.run_write(
            lambda s: s.execute(update(NodeGpuRow).where(where).values(holder_run_id=run))
        )

    def free() -> int:
        with db.read() as s:
            return s.get(NodeCapacityRow, "n1").available_gpus

    with db.read() as s:
        trigger = s.execute(
            text(
                "SELECT count(*) FROM sqlite_master WHERE type = 'trigger'"
                " AND name = 'node_gpus_capacity'"
                if db.is_sqlite
                else "SELECT count(*) FROM pg_trigger WHERE tgname = 'node_gpus_capacity'"
            )
        ).scalar_one()
    assert trigger == (1 if db.is_sqlite else 0)
    if not db.is_sqlite:
        return
    hold("r-a", where=gpus.gpu_index < 3)
    assert free() == 1
    hold("r-b", where=gpus.holder_run_id == "r-a")  # a holder replaced: no GPU comes back
    assert free() == 1
    hold(None, where=gpus.gpu_index == 0)
    assert free() == 2
    # corrupt the count by hand: freeing two more would pass the total, and is refused whole
    db.run_write(lambda s: s.execute(update(NodeCapacityRow).values(available_gpus=4)))
    with pytest.raises(IntegrityError):
        hold(None, where=gpus.holder_run_id == "r-b")
    with db.read() as s:
        assert list(s.scalars(select(NodeGpuRow.holder_run_id).order_by(gpus.gpu_index))) == [
            None,
            "r-b",
            "r-b",
            None,
        ]


def race(
    jobs: list[str], reserve_one: Callable[[str], allocate.Reserved]
) -> tuple[list[allocate.Reserved], list[CapacityConflict]]:
    """``reserve_one`` for every job at once (one thread each, released by a barrier): the
    reservations won and the capacity conflicts lost."""
    barrier = threading.Barrier(len(jobs))
    won: list[allocate.Reserved] = []
    lost: list[CapacityConflict] = []

    def go(job_id: str) -> None:
        barrier.wait()
        try:
            won.append(reserve_one(job_id))
        except CapacityConflict as exc:
            lost.append(exc)

    threads = [threading.Thread(target=go, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, lost


def test_racing_reservers_exactly_the_right_number_win(db: Database) -> None:
    """16 threads (each its own connection) race for 1-GPU... 3-GPU slices of one 8-GPU node:
    exactly floor(8/3) = 2 win, and no GPU is held twice."""
    create_team(db)
    create_node(db, "n1", gpus=8)
    epoch = become_leader(db)
    jobs = [submit(db, gpus=3).job_id for _ in range(16)]
    won, lost = race(jobs, lambda job_id: reserve(db, job_id, "n1", 3, epoch=epoch))
    assert len(won) == 2 and len(lost) == 14
    held = [g for r in won for g in r.gpu_ids]
    assert len(held) == len(set(held)) == 6
    assert violations(db) == []


def test_a_node_changes_its_gpu_count_only_while_nothing_is_reserved(db: Database) -> None:
    """A registration with another GPU count while GPUs are reserved keeps the recorded GPUs
    (the reservation stays whole) and drains the node; after the release, the next
    registration records the new count."""
    from gpufleet.store.tables import NodeRow

    create_team(db)
    create_node(db, "n1", gpus=8)
    epoch = become_leader(db)
    got = reserve(db, submit(db, gpus=2).job_id, "n1", 2, epoch=epoch)
    create_node(db, "n1", gpus=4)
    with db.read() as s:
        cap, node = s.get(NodeCapacityRow, "n1"), s.get(NodeRow, "n1")
        assert (cap.total_gpus, cap.available_gpus) == (8, 6)
        assert node.status == NodeStatus.DRAINING and "now reports 4 H100 GPU(s)" in (
            node.status_reason
        )
    db.run_write(lambda s: allocate.release(s, run_id=got.run_id, now=db_now(s), message="t"))
    create_node(db, "n1", gpus=4)
    with db.read() as s:
        cap = s.get(NodeCapacityRow, "n1")
        assert (cap.total_gpus, cap.available_gpus) == (4, 4)
    assert violations(db) == []


def _node(db: Database, node_id: str = "n1") -> tuple[str, str | None, str, int]:
    from gpufleet.store.tables import NodeRow

    with db.read() as s:
        node, cap = s.get(NodeRow, node_id), s.get(NodeCapacityRow, node_id)
        return node.status, node.status_reason, node.gpu_type, cap.total_gpus


def _status(db: Database, to: NodeStatus, reason: str | None = None) -> str:
    return db.run_write(
        lambda s: set_node_status(s, "n1", to, message="by an operator", reason=reason)
    )


def test_a_node_drained_for_a_gpu_change_is_uncordoned_only_after_its_agent_registers(
    db: Database,
) -> None:
    """Uncordoning a node drained for a change of GPUs before its agent registered again
    would offer GPUs the agent does not have: refused (409) until the next registration."""
    from gpufleet.domain.errors import Conflict

    create_team(db)
    create_node(db, "n1", gpus=8)
    got = reserve(db, submit(db, gpus=2).job_id, "n1", 2, epoch=become_leader(db))
    create_node(db, "n1", gpus=4)
    db.run_write(lambda s: allocate.release(s, run_id=got.run_id, now=db_now(s), message="t"))
    _status(db, NodeStatus.CORDONED, reason="drained")  # as the reconciler's drain would
    status, reason, _, total = _node(db)
    assert (status, total) == (NodeStatus.CORDONED, 8)
    assert (reason or "").startswith("drained; node n1 now reports 4"), reason
    with pytest.raises(Conflict, match="restart its agent"):
        _status(db, NodeStatus.HEALTHY)
    create_node(db, "n1", gpus=4)
    status, reason, _, total = _node(db)
    assert (status, total) == (NodeStatus.CORDONED, 4) and "uncordon it" in (reason or "")
    _status(db, NodeStatus.HEALTHY)
    assert _node(db)[:2] == (NodeStatus.HEALTHY, None)


def test_an_agent_back_at_its_recorded_gpus_ends_the_drain(db: Database) -> None:
    create_team(db)
    create_node(db, "n1", gpus=8)
    reserve(db, submit(db, gpus=2).job_id, "n1", 2, epoch=become_leader(db))
    create_node(db, "n1", gpus=4)
    assert _node(db)[0] == NodeStatus.DRAINING
    create_node(db, "n1", gpus=8)
    assert _node(db) == (NodeStatus.HEALTHY, None, "H100", 8)


def test_a_gpu_type_change_while_reserved_drains_and_keeps_the_type(db: Database) -> None:
    """The same GPU count of another type is a change of GPUs too: recorded at once when
    nothing is reserved (the GPU rows replaced), kept and drained otherwise."""
    from gpufleet.store.tables import NodeGpuRow

    create_team(db)
    create_node(db, "n1", gpus=8)
    got = reserve(db, submit(db, gpus=2).job_id, "n1", 2, epoch=become_leader(db))
    create_node(db, "n1", gpus=8, gpu_type="A100")
    status, reason, gpu_type, _ = _node(db)
    assert (status, gpu_type) == (NodeStatus.DRAINING, "H100") and "A100" in (reason or "")
    db.run_write(lambda s: allocate.release(s, run_id=got.run_id, now=db_now(s), message="t"))
    create_node(db, "n1", gpus=8, gpu_type="A100")
    assert _node(db)[2:] == ("A100", 8)
    with db.read() as s:
        types = set(s.scalars(select(NodeGpuRow.gpu_type).where(NodeGpuRow.node_id == "n1")))
    assert types == {"A100"}
    assert violations(db) == []


def test_an_operators_cordon_reason_is_kept_and_a_quarantined_node_is_refused(
    db: Database,
) -> None:
    """A cordoned node drained for a change of GPUs keeps the operator's reason in front;
    a QUARANTINED node (its GPUs not known free) is refused the change, as before."""
    from gpufleet.domain.errors import Conflict
    from gpufleet.services.nodes import fence_node

    create_team(db)
    create_node(db, "n1", gpus=8)
    reserve(db, submit(db, gpus=2).job_id, "n1", 2, epoch=become_leader(db))
    _status(db, NodeStatus.CORDONED, reason="fan failure")
    create_node(db, "n1", gpus=4)
    status, reason, _, total = _node(db)
    assert (status, total) == (NodeStatus.DRAINING, 8)
    assert (reason or "").startswith("fan failure; node n1 now reports 4 H100 GPU(s)")
    create_node(db, "n2", gpus=8)
    reserve(db, submit(db, gpus=2).job_id, "n2", 2, epoch=become_leader(db))
    db.run_write(
        lambda s: fence_node(
            s, "n2", reason="gone", max_node_failures=3, node_to=NodeStatus.QUARANTINED
        )
    )
    assert _node(db, "n2")[0] == NodeStatus.QUARANTINED
    with pytest.raises(Conflict, match="while GPUs are reserved"):
        create_node(db, "n2", gpus=2)
    assert _node(db, "n2")[3] == 8


def place(
    db: Database, job_id: str, node_id: str, n: int, *, epoch: int, seen: int = 0, **kw: object
) -> allocate.Reserved:
    """The scheduler's entry point: one statement on PostgreSQL, a transaction on SQLite."""
    return allocate.place(
        db,
        job_id=job_id,
        node_id=node_id,
        gpu_count=n,
        seen_fencing_epoch=seen,
        leader_holder=str(kw.get("holder", "test-leader")),
        leader_epoch=epoch,
        lease_s=60,
        holds=bool(kw.get("holds", False)),
    )


def _state(db: Database) -> tuple[object, ...]:
    """What a failed placement must leave untouched: capacity, GPU holders, runs,
    reservations, events."""
    from sqlalchemy import func, select

    from gpufleet.store.tables import (
        JobRunRow,
        NodeGpuRow,
        ReservationRow,
        SchedulingEventRow,
    )

    with db.read() as s:
        return (
            s.get(NodeCapacityRow, "n1").available_gpus,
            tuple(s.scalars(select(NodeGpuRow.holder_run_id).order_by(NodeGpuRow.gpu_index))),
            s.scalar(select(func.count()).select_from(JobRunRow)),
            s.scalar(select(func.count()).select_from(ReservationRow)),
            s.scalar(select(func.count()).select_from(SchedulingEventRow)),
        )


class TestPlace:
    """``allocate.place``: the same outcomes as ``reserve`` in a transaction, all or nothing
    (on PostgreSQL one statement in autocommit, ``store.reserve_once``)."""

    def test_places_like_reserve(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1", gpus=8)
        epoch = become_leader(db)
        a = place(db, submit(db, gpus=3).job_id, "n1", 3, epoch=epoch)
        b = place(db, submit(db, gpus=2).job_id, "n1", 2, epoch=epoch, holds=True)
        assert (a.gpu_ids, b.gpu_ids) == ((0, 1, 2), (3, 4))
        assert (a.token, a.attempt) == (1, 1)
        with db.read() as s:
            assert s.get(NodeCapacityRow, "n1").available_gpus == 3
            row = s.get(JobRow, a.job_id)
            assert (row.status, row.current_run_id, row.fencing_epoch, row.attempts) == (
                "SCHEDULED",
                a.run_id,
                1,
                1,
            )
            assert row.scheduled_at is not None and row.pending_reason is None
        assert violations(db) == []

    @pytest.mark.parametrize(
        ("case", "want"),
        [
            pytest.param("stale epoch", StaleState, id="the job moved past the seen epoch"),
            pytest.param("held", StaleState, id="a hold that landed after the pass wins"),
            pytest.param("not leader", NotLeader, id="a deposed leader's epoch"),
            pytest.param("full", CapacityConflict, id="too few free GPUs"),
            pytest.param("unhealthy", CapacityConflict, id="the node is not HEALTHY"),
        ],
    )
    def test_a_refused_placement_changes_nothing(
        self, db: Database, case: str, want: type[Exception]
    ) -> None:
        create_team(db)
        create_node(db, "n1", gpus=8)
        epoch = become_leader(db)
        place(db, submit(db, gpus=4).job_id, "n1", 4, epoch=epoch)
        job = submit(db, gpus=4 if case != "full" else 5)
        seen = 0
        if case == "stale epoch":
            seen = 7
        elif case == "held":
            db.run_write(
                lambda s: s.get(JobRow, job.job_id).__setattr__("held", True)  # type: ignore[union-attr]
            )
        elif case == "not leader":
            epoch += 1
        elif case == "unhealthy":
            db.run_write(lambda s: set_node_status(s, "n1", NodeStatus.CORDONED, message="t"))
        before = _state(db)
        with pytest.raises(want):
            place(db, job.job_id, "n1", 4 if case != "full" else 5, epoch=epoch, seen=seen)
        assert _state(db) == before
        with db.read() as s:
            assert s.get(JobRow, job.job_id).status == JobStatus.PENDING
        assert violations(db) == []


def test_racing_placements_exactly_the_right_number_win(db: Database) -> None:
    """Six threads place 2-GPU jobs on one 8-GPU node at once: exactly four win, with
    disjoint GPUs, and the rest see a capacity conflict."""
    create_team(db)
    create_node(db, "n1", gpus=8)
    epoch = become_leader(db)
    jobs = [submit(db, gpus=2).job_id for _ in range(6)]
    won, lost = race(jobs, lambda job_id: place(db, job_id, "n1", 2, epoch=epoch))
    assert (len(won), len(lost)) == (4, 2)
    held = [g for r in won for g in r.gpu_ids]
    assert sorted(held) == list(range(8))
    assert violations(db) == []
