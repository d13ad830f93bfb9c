"""Gang (multi-node) attempts in the store, on SQLite and real PostgreSQL: every member
reserved or none, one token per attempt, the whole gang stopped and retried as one unit, each
member's GPUs back as soon as that member is verified gone (the invariant is per GPU)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

from gpufleet.domain.errors import CapacityConflict, StaleState, ValidationFailed
from gpufleet.domain.states import JobStatus, RunStatus
from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.decisions import Preempt
from gpufleet.services import jobctl, nodes, preemption, runs
from gpufleet.services.jobs import submit_job
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import check_database, load_snapshot
from gpufleet.store.tables import GpuHoldRow, JobRow, JobRunRow, NodeCapacityRow, ReservationRow
from tests.factories import become_leader, create_node, create_team
from tests.store.test_runs import write_manifest


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(str(tmp_path / "objects"))


def submit_gang(
    db: Database, nodes_: int = 2, per_node: int = 2, max_retries: int = 0, priority: str = "LOW"
) -> str:
    spec = JobSpec(
        command=("true",),
        resources=Resources(nodes_ * per_node, nodes=nodes_, gpus_per_node=per_node),
        priority=PriorityClass(priority),
        max_retries=max_retries,
    )
    return submit_job(db, team_id="team-a", idempotency_key=str(uuid.uuid4()), spec=spec).job_id


def reserve_gang(
    db: Database, job_id: str, members: list[tuple[int, str, int]], epoch: int, seen: int = 0
) -> allocate.ReservedGang:
    return db.run_write(
        lambda s: allocate.reserve_gang(
            s,
            job_id=job_id,
            members=members,
            seen_fencing_epoch=seen,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
        )
    )


def violations(db: Database) -> list[str]:
    return [str(v) for v in check_database(db)[1]]


def free(db: Database) -> dict[str, int]:
    with db.read() as s:
        return {c.node_id: c.available_gpus for c in s.query(NodeCapacityRow).all()}


def job_and_runs(db: Database, job_id: str) -> tuple[JobRow, list[JobRunRow]]:
    with db.read() as s:
        job = s.get(JobRow, job_id)
        rows = (
            s.query(JobRunRow)
            .filter_by(job_id=job_id)
            .order_by(JobRunRow.attempt, JobRunRow.rank)
            .all()
        )
        return job, rows


def fleet(db: Database, n: int = 4, gpus: int = 8) -> int:
    create_team(db)
    for i in range(1, n + 1):
        create_node(db, f"n{i}", gpus=gpus)
    return become_leader(db)


def exited(store: ObjectStore, job_id: str, r: allocate.Reserved, code: int = 0) -> runs.Report:
    uri = write_manifest(store, job_id, r.run_id, r.token, code)
    return runs.Report(r.node_id, r.run_id, r.token, runs.Outcome.EXITED, code, uri)


def stopped(r: allocate.Reserved) -> runs.Report:
    return runs.Report(r.node_id, r.run_id, r.token, runs.Outcome.STOPPED, -15, "")


def confirm(db: Database, r: allocate.Reserved) -> runs.Confirm:
    return db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token, 100))


class TestReserveGang:
    def test_every_member_gets_a_run_and_a_reservation_under_one_token(self, db: Database) -> None:
        epoch = fleet(db)
        job_id = submit_gang(db)
        got = reserve_gang(db, job_id, [(0, "n3", 2), (1, "n1", 2)], epoch)
        assert [m.node_id for m in got.members] == ["n3", "n1"]
        assert {m.token for m in got.members} == {1} and got.attempt == 1
        job, rows = job_and_runs(db, job_id)
        assert job.status == JobStatus.SCHEDULED and job.current_run_id == got.members[0].run_id
        assert [(r.rank, r.gang_size, r.node_id, r.token) for r in rows] == [
            (0, 2, "n3", 1),
            (1, 2, "n1", 1),
        ]
        assert free(db) == {"n1": 6, "n2": 8, "n3": 6, "n4": 8}
        with db.snapshot() as s:
            snap = load_snapshot(s, db_now(s))
        assert sorted((r.rank, r.gang_size) for r in snap.running) == [(0, 2), (1, 2)]
        assert violations(db) == []

    def test_one_member_that_does_not_fit_reserves_nothing(self, db: Database) -> None:
        epoch = fleet(db)
        blocker = submit_gang(db, nodes_=1, per_node=7)
        reserve_gang(db, blocker, [(0, "n2", 7)], epoch)
        job_id = submit_gang(db)
        with pytest.raises(CapacityConflict):
            reserve_gang(db, job_id, [(0, "n1", 2), (1, "n2", 2)], epoch)
        job, rows = job_and_runs(db, job_id)
        assert (job.status, job.fencing_epoch, rows) == (JobStatus.PENDING, 0, [])
        assert free(db) == {"n1": 8, "n2": 1, "n3": 8, "n4": 8}
        assert violations(db) == []

    def test_a_held_gang_is_not_reserved(self, db: Database) -> None:
        # a hold that lands after the pass's snapshot wins over its gang placement, as for a
        # single-node job (the gang path once lacked the `held` guard)
        epoch = fleet(db)
        job_id = submit_gang(db)
        db.run_write(lambda s: jobctl.hold_job(s, "team-a", job_id))
        with pytest.raises(StaleState):
            reserve_gang(db, job_id, [(0, "n1", 2), (1, "n2", 2)], epoch)
        job, rows = job_and_runs(db, job_id)
        assert (job.status, job.fencing_epoch, rows) == (JobStatus.PENDING, 0, [])
        assert free(db) == {"n1": 8, "n2": 8, "n3": 8, "n4": 8}

    def test_bad_ranks_or_a_repeated_node_are_refused(self, db: Database) -> None:
        epoch = fleet(db)
        job_id = submit_gang(db)
        with pytest.raises(ValueError, match="ranks"):
            reserve_gang(db, job_id, [(0, "n1", 2), (2, "n2", 2)], epoch)
        with pytest.raises(ValueError, match="one node"):
            reserve_gang(db, job_id, [(0, "n1", 2), (1, "n1", 2)], epoch)
        assert free(db)["n1"] == 8


def test_racing_gangs_are_all_or_nothing_without_deadlock(db: Database) -> None:
    """8 threads (own connections) reserve overlapping 2-node gangs of 6+6 GPUs on 4 nodes of
    8, ranks in both node orders: every gang has both members or none, no GPU is in two live
    reservations, every thread ends (bounded time; a lock-order deadlock would raise on
    PostgreSQL or hang), and the invariant checker finds nothing. Three rounds."""
    epoch = fleet(db)
    pairs = [("n1", "n2"), ("n2", "n1"), ("n2", "n3"), ("n4", "n3"), ("n3", "n4"), ("n4", "n1")]
    pairs += [("n1", "n3"), ("n4", "n2")]
    for _round in range(3):
        jobs = [submit_gang(db, per_node=6) for _ in pairs]
        barrier = threading.Barrier(len(jobs))
        won: list[allocate.ReservedGang] = []
        lost: list[Exception] = []
        other: list[BaseException] = []

        def go(
            job_id: str,
            a: str,
            b: str,
            barrier: threading.Barrier = barrier,
            won: list[allocate.ReservedGang] = won,
            lost: list[Exception] = lost,
            other: list[BaseException] = other,
        ) -> None:
            barrier.wait()
            try:
                won.append(reserve_gang(db, job_id, [(0, a, 6), (1, b, 6)], epoch))
            except CapacityConflict as exc:
                lost.append(exc)
            except BaseException as exc:  # e.g. a deadlock: must not happen
                other.append(exc)

        threads = [
            threading.Thread(target=go, args=(j, a, b))
            for j, (a, b) in zip(jobs, pairs, strict=True)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a reserving thread never ended"
        assert other == [] and len(won) + len(lost) == len(pairs)
        assert 1 <= len(won) <= 2  # 4 nodes, 2 whole-ish nodes per gang
        used = {m.node_id for g in won for m in g.members}
        assert len(used) == 2 * len(won)
        for job_id in jobs:
            job, rows = job_and_runs(db, job_id)
            assert len(rows) in (0, 2), (job_id, rows)
            assert (job.status == JobStatus.SCHEDULED) == (len(rows) == 2)
        with db.read() as s:
            live = s.query(ReservationRow).filter(ReservationRow.status == "RESERVED").all()
            held = [(r.node_id, g) for r in live for g in r.gpu_ids]
        assert len(held) == len(set(held)) == 12 * len(won)
        assert violations(db) == []
        print(f"round {_round}: {len(won)} gang(s) won in {time.monotonic() - t0:.2f} s")
        for g in won:  # free the fleet for the next round: both members report gone
            for m in g.members:
                db.run_write(lambda s, m=m: runs.confirm_assignment(s, m.run_id, m.token, 1))
            for m in g.members:
                runs.complete_run(db, ObjectStore("/nonexistent"), stopped(m))
        assert set(free(db).values()) == {8}


class TestGangLifecycle:
    def test_running_when_every_member_confirmed_and_succeeded_once_all_are_in(
        self, db: Database, store: ObjectStore
    ) -> None:
        epoch = fleet(db)
        job_id = submit_gang(db)
        g = reserve_gang(db, job_id, [(0, "n1", 2), (1, "n2", 2)], epoch)
        r0, r1 = g.members
        assert confirm(db, r1) == runs.Confirm.CONFIRMED
        assert job_and_runs(db, job_id)[0].status == JobStatus.SCHEDULED
        assert confirm(db, r0) == runs.Confirm.CONFIRMED
        assert job_and_runs(db, job_id)[0].status == JobStatus.RUNNING
        result, _ = runs.complete_run(db, store, exited(store, job_id, r1))
        assert result == runs.CompletionResult.ACCEPTED
        job, rows = job_and_runs(db, job_id)
        assert job.status == JobStatus.RUNNING and rows[1].status == RunStatus.SUCCEEDED
        assert free(db)["n2"] == 8  # a member's GPUs come back on its own agent's word
        with db.snapshot() as s:  # ... and the policy sees who still holds GPUs
            snap = load_snapshot(s, db_now(s))
        held = {r.run_id: r.stopping for r in snap.running}
        assert held == {r0.run_id: False}
        assert violations(db) == []
        rep0 = exited(store, job_id, r0)
        runs.complete_run(db, store, rep0)
        job, rows = job_and_runs(db, job_id)
        assert job.status == JobStatus.SUCCEEDED and job.result_uri == rep0.manifest_uri
        assert free(db) == {"n1": 8, "n2": 8, "n3": 8, "n4": 8}
        assert violations(db) == []

    def test_one_rank_failing_stops_the_others_and_retries_as_one_new_attempt(
        self, db: Database, store: ObjectStore
    ) -> None:
        epoch = fleet(db)
        job_id = submit_gang(db, max_retries=1)
        g = reserve_gang(db, job_id, [(0, "n1", 2), (1, "n2", 2)], epoch)
        r0, r1 = g.members
        confirm(db, r0), confirm(db, r1)
        runs.complete_run(db, store, exited(store, job_id, r1, code=3))
        job, rows = job_and_runs(db, job_id)
        assert job.status == JobStatus.RUNNING
        assert (rows[0].status, rows[0].stop_reason) == (RunStatus.PREEMPTING, "gang")
        assert (rows[1].status, rows[1].gang_outcome) == (RunStatus.FAILED, "PENDING")
        # r1's processes are gone: its GPUs are back; r0's stay until it is verified stopped
        assert free(db)["n2"] == 8 and free(db)["n1"] == 6
        with db.snapshot() as s:
            snap = load_snapshot(s, db_now(s))
        assert {r.run_id: r.stopping for r in snap.running} == {r0.run_id: True}
        assert violations(db) == []
        runs.complete_run(db, store, stopped(r0))
        job, rows = job_and_runs(db, job_id)
        assert job.status == JobStatus.PENDING and job.retry_after is not None
        assert rows[0].charged_to == "system" and rows[1].charged_to == "job"
        assert set(free(db).values()) == {8}
        again = reserve_gang(db, job_id, [(0, "n3", 2), (1, "n4", 2)], epoch, seen=1)
        assert {m.token for m in again.members} == {2}
        # a report of the old attempt changes nothing
        late = runs.complete_run(db, store, exited(store, job_id, r0))
        assert late[0] in (runs.CompletionResult.ACCEPTED, runs.CompletionResult.STALE)
        assert job_and_runs(db, job_id)[0].status == JobStatus.SCHEDULED
        # the second failure uses the last retry: FAILED, once every member is gone
        for m in again.members:
            confirm(db, m)
        runs.complete_run(db, store, exited(store, job_id, again.members[0], code=1))
        runs.complete_run(db, store, stopped(again.members[1]))
        job, _ = job_and_runs(db, job_id)
        assert job.status == JobStatus.FAILED
        assert violations(db) == []

    def test_preempting_one_member_stops_the_whole_gang_and_reuses_a_node_once_its_member_is_gone(
        self, db: Database
    ) -> None:
        epoch = fleet(db, n=2)
        job_id = submit_gang(db, per_node=8)
        g = reserve_gang(db, job_id, [(0, "n1", 8), (1, "n2", 8)], epoch)
        for m in g.members:
            confirm(db, m)
        critical = submit_gang(db, nodes_=1, per_node=8, priority="CRITICAL")
        decision = Preempt(critical, "n2", (g.members[1].run_id,), "priority", gpu_count=8)
        orders = db.run_write(
            lambda s: preemption.apply_preempt(
                s, decision, leader_holder="test-leader", leader_epoch=epoch
            )
        )
        assert sorted(o.run_id for o in orders) == sorted(m.run_id for m in g.members)
        with db.read() as s:
            assert [(h.job_id, h.node_id) for h in s.query(GpuHoldRow).all()] == [(critical, "n2")]
        store_ = ObjectStore("/nonexistent")
        runs.complete_run(db, store_, stopped(g.members[1]))
        # rank 1 is verified gone: n2's GPUs are back (held for the preemptor); rank 0 still
        # stops, and n1's GPUs are not reusable until it is gone
        assert free(db) == {"n1": 0, "n2": 8}
        with pytest.raises(CapacityConflict):
            db.run_write(
                lambda s: allocate.reserve(
                    s,
                    job_id=critical,
                    node_id="n1",
                    gpu_count=8,
                    seen_fencing_epoch=0,
                    leader_holder="test-leader",
                    leader_epoch=epoch,
                    lease_s=60,
                )
            )
        db.run_write(
            lambda s: allocate.reserve(
                s,
                job_id=critical,
                node_id="n2",
                gpu_count=8,
                seen_fencing_epoch=0,
                leader_holder="test-leader",
                leader_epoch=epoch,
                lease_s=60,
            )
        )
        assert violations(db) == []
        runs.complete_run(db, store_, stopped(g.members[0]))
        job, rows = job_and_runs(db, job_id)
        assert job.status == JobStatus.PENDING
        assert [r.status for r in rows] == [RunStatus.PREEMPTED, RunStatus.PREEMPTED]
        assert free(db) == {"n1": 8, "n2": 0}
        assert violations(db) == []

    def test_a_fenced_member_stops_the_rest_and_requeues_the_job(
        self, db: Database, store: ObjectStore
    ) -> None:
        epoch = fleet(db, n=2)
        job_id = submit_gang(db)
        g = reserve_gang(db, job_id, [(0, "n1", 2), (1, "n2", 2)], epoch)
        for m in g.members:
            confirm(db, m)
        db.run_write(lambda s: nodes.fence_node(s, "n2", reason="silent", max_node_failures=3))
        job, rows = job_and_runs(db, job_id)
        assert job.status == JobStatus.RUNNING
        assert [r.status for r in rows] == [RunStatus.PREEMPTING, RunStatus.FENCED]
        assert violations(db) == []
        runs.complete_run(db, store, stopped(g.members[0]))
        job, _ = job_and_runs(db, job_id)
        assert job.status == JobStatus.PENDING
        assert free(db) == {"n1": 8, "n2": 6}  # n2's GPUs wait for its agent's word
        assert violations(db) == []


class TestGangValidation:
    def test_a_gang_no_set_of_nodes_could_hold_is_refused_naming_the_field(
        self, db: Database
    ) -> None:
        fleet(db, n=2, gpus=4)
        ok = submit_gang(db, nodes_=2, per_node=4)
        assert ok
        with pytest.raises(ValidationFailed) as too_many:
            submit_gang(db, nodes_=3, per_node=4)
        assert too_many.value.field == "nodes"
        with pytest.raises(ValidationFailed) as too_big:
            submit_gang(db, nodes_=2, per_node=8)
        assert too_big.value.field == "gpus_per_node"

    def test_a_derived_gang_is_whole_nodes_unless_partial_nodes_are_allowed(
        self, db: Database
    ) -> None:
        fleet(db, n=3, gpus=4)

        def derived(gpus: int, partial: bool = False) -> str:
            spec = JobSpec(
                command=("true",), resources=Resources(gpus, allow_partial_nodes=partial)
            )
            return submit_job(
                db, team_id="team-a", idempotency_key=str(uuid.uuid4()), spec=spec
            ).job_id

        assert derived(8)  # 2 whole nodes
        with pytest.raises(ValidationFailed) as uneven:
            derived(6)
        assert uneven.value.field == "gpu_count"
        assert derived(6, partial=True)
        with pytest.raises(ValidationFailed) as big:
            derived(16)
        assert big.value.field == "gpu_count"  # the field the user set


def test_a_cancelled_gang_ends_cancelled_once_every_member_is_gone(
    db: Database, store: ObjectStore
) -> None:
    epoch = fleet(db, n=2)
    job_id = submit_gang(db, max_retries=3)
    g = reserve_gang(db, job_id, [(0, "n1", 2), (1, "n2", 2)], epoch)
    for m in g.members:
        confirm(db, m)
    for m in g.members:  # what the stop driver does for a cancel_requested job
        db.run_write(
            lambda s, m=m: runs.request_stop(s, m.run_id, m.token, "cancel", message="cancel")
        )
    runs.complete_run(db, store, stopped(g.members[1]))
    assert job_and_runs(db, job_id)[0].status == JobStatus.RUNNING
    runs.complete_run(db, store, stopped(g.members[0]))
    job, rows = job_and_runs(db, job_id)
    assert job.status == JobStatus.CANCELLED
    assert [r.status for r in rows] == [RunStatus.CANCELLED, RunStatus.CANCELLED]
    assert free(db) == {"n1": 8, "n2": 8}
    assert violations(db) == []
