"""GPU shares in the allocation transaction, on both databases: several share reservations on
one GPU, the sum of a GPU's shares never above one GPU, a whole-GPU reservation never on a GPU
holding shares (and no share on a GPU held whole), release per share, the schema's own
checks, and 8 racing reservers of overlapping shares."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from gpufleet.domain.errors import CapacityConflict
from gpufleet.domain.invariants import (
    InvariantView,
    NodeView,
    ReservationView,
    check_invariants,
)
from gpufleet.domain.states import ReservationStatus
from gpufleet.domain.types import SHARED_GPU_HOLDER
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import check_database
from gpufleet.store.tables import NodeCapacityRow, NodeGpuRow, ReservationRow
from tests.factories import become_leader, create_node, create_team, submit
from tests.store.test_allocate import race, reserve


def share(db: Database, job_id: str, milli: int, *, epoch: int, node: str = "n1"):
    return db.run_write(
        lambda s: allocate.reserve(
            s,
            job_id=job_id,
            node_id=node,
            gpu_count=1,
            seen_fencing_epoch=0,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
            now=db_now(s),
            gpu_milli=milli,
        )
    )


def release(db: Database, run_id: str) -> float:
    return db.run_write(lambda s: allocate.release(s, run_id=run_id, now=None, message="stopped"))


def violations(db: Database) -> list[str]:
    return [str(v) for v in check_database(db)[1]]


def gpus(db: Database, node: str = "n1") -> dict[int, tuple[str | None, int]]:
    with db.read() as s:
        rows = s.execute(
            select(NodeGpuRow.gpu_index, NodeGpuRow.holder_run_id, NodeGpuRow.shared_milli).where(
                NodeGpuRow.node_id == node
            )
        ).all()
    return {r[0]: (r[1], r[2]) for r in rows}


def available(db: Database, node: str = "n1") -> int:
    with db.read() as s:
        return s.get(NodeCapacityRow, node).available_gpus


@pytest.fixture
def fleet(db: Database) -> int:
    create_team(db)
    create_node(db, "n1", gpus=2, gpu_sharing="timeslice")
    create_node(db, "whole", gpus=2)
    return become_leader(db)


class TestShares:
    def test_two_halves_share_one_gpu_and_a_third_opens_the_next(
        self, db: Database, fleet: int
    ) -> None:
        jobs = [submit(db, gpus=1).job_id for _ in range(3)]
        a, b = share(db, jobs[0], 500, epoch=fleet), share(db, jobs[1], 500, epoch=fleet)
        assert a.gpu_ids == b.gpu_ids == (0,)
        assert gpus(db)[0] == (SHARED_GPU_HOLDER, 1000)
        assert available(db) == 1  # the shared GPU is not a free whole GPU
        c = share(db, jobs[2], 500, epoch=fleet)
        assert c.gpu_ids == (1,) and available(db) == 0
        assert violations(db) == []
        with db.read() as s:
            row = s.execute(select(ReservationRow).where(ReservationRow.run_id == a.run_id))
            r = row.scalar_one()
            assert (r.gpu_count, r.gpu_milli, r.gpu_ids) == (0, 500, [0])

    def test_best_fit_prefers_the_fullest_gpu_that_has_room(
        self, db: Database, fleet: int
    ) -> None:
        jobs = [submit(db, gpus=1).job_id for _ in range(4)]
        share(db, jobs[0], 750, epoch=fleet)  # GPU 0: 0.75
        assert share(db, jobs[1], 500, epoch=fleet).gpu_ids == (1,)  # 0.5 does not fit GPU 0
        # 0.25 fits both: the fuller (GPU 0, 0.75) takes it, GPU 1 keeps room for 0.5
        assert share(db, jobs[2], 250, epoch=fleet).gpu_ids == (0,)
        assert share(db, jobs[3], 500, epoch=fleet).gpu_ids == (1,)
        assert gpus(db) == {0: (SHARED_GPU_HOLDER, 1000), 1: (SHARED_GPU_HOLDER, 1000)}
        assert violations(db) == []

    def test_whole_gpus_and_shares_never_mix_on_a_gpu(self, db: Database, fleet: int) -> None:
        jobs = [submit(db, gpus=1).job_id for _ in range(4)]
        whole = reserve(db, jobs[0], "n1", 1, epoch=fleet)
        assert whole.gpu_ids == (0,)
        half = share(db, jobs[1], 500, epoch=fleet)
        assert half.gpu_ids == (1,)  # not on GPU 0, held whole
        with pytest.raises(CapacityConflict):  # GPU 1 holds a share: not a free whole GPU
            reserve(db, jobs[2], "n1", 1, epoch=fleet)
        with pytest.raises(CapacityConflict):  # 0.75 fits neither GPU
            share(db, jobs[3], 750, epoch=fleet)
        assert violations(db) == []

    def test_a_node_that_does_not_share_gets_no_share(self, db: Database, fleet: int) -> None:
        job = submit(db, gpus=1).job_id
        with pytest.raises(CapacityConflict, match="not shared"):
            share(db, job, 500, epoch=fleet, node="whole")
        assert gpus(db, "whole") == {0: (None, 0), 1: (None, 0)}

    def test_release_gives_back_each_share_and_the_gpu_with_the_last(
        self, db: Database, fleet: int
    ) -> None:
        jobs = [submit(db, gpus=1).job_id for _ in range(3)]
        a, b = share(db, jobs[0], 250, epoch=fleet), share(db, jobs[1], 500, epoch=fleet)
        assert release(db, a.run_id) == 0.25  # its fraction; GPU 0 still holds b's share
        assert gpus(db)[0] == (SHARED_GPU_HOLDER, 500) and available(db) == 1
        assert release(db, a.run_id) == 0  # twice: a no-op
        assert gpus(db)[0] == (SHARED_GPU_HOLDER, 500)
        assert release(db, b.run_id) == 0.5  # the last share: a whole free GPU again
        assert gpus(db)[0] == (None, 0) and available(db) == 2
        assert reserve(db, jobs[2], "n1", 2, epoch=fleet).gpu_ids == (0, 1)
        assert violations(db) == []

    def test_a_quarantined_share_still_holds_its_part(self, db: Database, fleet: int) -> None:
        """Fencing moves a share's reservation to QUARANTINED: its part stays held until the
        agent's word, as a whole GPU's (release with only_quarantined)."""
        jobs = [submit(db, gpus=1).job_id for _ in range(2)]
        a = share(db, jobs[0], 500, epoch=fleet)
        db.run_write(
            lambda s: s.execute(
                update(ReservationRow)
                .where(ReservationRow.run_id == a.run_id)
                .values(status=ReservationStatus.QUARANTINED)
            )
        )
        assert violations(db) == []  # a QUARANTINED share counts as held
        assert share(db, jobs[1], 750, epoch=fleet).gpu_ids == (1,)
        got = db.run_write(
            lambda s: allocate.release(
                s, run_id=a.run_id, now=None, message="agent: gone", only_quarantined=True
            )
        )
        assert got == 0.5 and gpus(db)[0] == (None, 0)
        assert violations(db) == []


class TestSchemaChecks:
    """The database itself refuses a GPU row whose shares exceed one GPU, or that holds a
    share and a whole-GPU holder at once (whatever the code does)."""

    @pytest.mark.parametrize(
        ("holder", "milli"),
        [
            pytest.param(SHARED_GPU_HOLDER, 1001, id="more than one GPU"),
            pytest.param(SHARED_GPU_HOLDER, -1, id="negative"),
            pytest.param("run-x", 500, id="whole holder with a share"),
            pytest.param(None, 500, id="share without the share holder"),
            pytest.param(SHARED_GPU_HOLDER, 0, id="share holder without a share"),
        ],
    )
    def test_refused(self, db: Database, fleet: int, holder: str | None, milli: int) -> None:
        with pytest.raises(IntegrityError):
            db.run_write(
                lambda s: s.execute(
                    update(NodeGpuRow)
                    .where(NodeGpuRow.node_id == "n1", NodeGpuRow.gpu_index == 0)
                    .values(holder_run_id=holder, shared_milli=milli)
                )
            )


def test_racing_share_reservers_never_exceed_one_gpu(db: Database) -> None:
    """8 threads (each its own connection) reserve overlapping shares (3/8, 1/2, 5/8 of a GPU)
    of one 2-GPU shared node at once, twice over: no GPU ever holds more than one GPU, the
    records match the reservations and the invariant check is clean."""
    create_team(db)
    create_node(db, "n1", gpus=2, gpu_sharing="mps")
    epoch = become_leader(db)
    sizes = [375, 500, 625, 500, 375, 625, 500, 375]
    for _ in range(2):
        jobs = {submit(db, gpus=1).job_id: m for m in sizes}
        won, lost = race(
            list(jobs), lambda job_id, jobs=jobs: share(db, job_id, jobs[job_id], epoch=epoch)
        )
        assert len(won) + len(lost) == 8 and won
        per_gpu: dict[int, int] = {}
        for r in won:
            per_gpu[r.gpu_ids[0]] = per_gpu.get(r.gpu_ids[0], 0) + jobs[r.job_id]
        assert all(total <= 1000 for total in per_gpu.values()), per_gpu
        assert {g: m for g, (_, m) in gpus(db).items() if m} == per_gpu
        # a lost reserver lost only because no GPU had room for its share
        assert all("room" in str(exc) for exc in lost), lost
        assert violations(db) == []
        for r in won:
            release(db, r.run_id)
        assert gpus(db) == {0: (None, 0), 1: (None, 0)}
        assert violations(db) == []


def test_a_shares_usage_record_charges_its_fraction(db: Database, fleet: int) -> None:
    """A 0.25-GPU attempt is charged 0.25 GPU-seconds per second it held its share, in its
    usage record and in a window clipped out of it."""
    from datetime import timedelta

    from gpufleet.store import accounting
    from gpufleet.store.tables import UsageRecordRow

    a = share(db, submit(db, gpus=1).job_id, 250, epoch=fleet)
    with db.read() as s:
        start = s.execute(
            select(ReservationRow.created_at).where(ReservationRow.run_id == a.run_id)
        ).scalar_one()
    end = start + timedelta(seconds=100)
    db.run_write(
        lambda s: accounting.record_attempt_end(s, a.run_id, outcome="SUCCEEDED", end_at=end)
    )
    with db.read() as s:
        rec = s.get(UsageRecordRow, a.run_id)
        assert (rec.gpus, rec.gpu_seconds) == (1, pytest.approx(25.0))
        half = accounting.clipped_gpu_seconds(rec, start + timedelta(seconds=50), None)
        assert half == pytest.approx(12.5)


def test_the_checker_reports_overbooked_and_mixed_gpus() -> None:
    node = NodeView(
        "n1",
        2,
        0,
        {0: SHARED_GPU_HOLDER, 1: "r3"},
        gpu_shares={0: 1250},
    )
    res = (
        ReservationView("a", "r1", "j1", "n1", (0,), "CONFIRMED", 750),
        ReservationView("b", "r2", "j2", "n1", (0,), "CONFIRMED", 500),
        ReservationView("c", "r3", "j3", "n1", (1,), "CONFIRMED"),
        ReservationView("d", "r4", "j4", "n1", (1,), "CONFIRMED", 250),
    )
    found = [str(v) for v in check_invariants(InvariantView((node,), res, (), ()))]
    assert any("sum to 1.25 of a GPU" in v for v in found), found
    assert any("held whole by ['r3'] and shared by ['r4']" in v for v in found), found


def test_fencing_a_node_with_shares_quarantines_them_until_the_agents_word(
    db: Database, fleet: int
) -> None:
    """A fence moves each share's reservation to QUARANTINED with the attempt FENCED (its
    job re-queued): the GPU keeps its shares, no new share or whole job gets it, and only the
    agent's word (here: an operator confirming the node dead) gives it back whole."""
    from gpufleet.services import nodes
    from gpufleet.services.node_fence import release_gone_quarantined

    jobs = [submit(db, gpus=1).job_id for _ in range(3)]
    a, b = share(db, jobs[0], 500, epoch=fleet), share(db, jobs[1], 375, epoch=fleet)
    fenced = db.run_write(
        lambda s: nodes.fence_node(s, "n1", reason="silent", max_node_failures=3)
    )
    assert {f.run_id for f in fenced} == {a.run_id, b.run_id}
    with db.read() as s:
        states = s.execute(
            select(ReservationRow.status).where(ReservationRow.node_id == "n1")
        ).scalars()
        assert set(states) == {ReservationStatus.QUARANTINED}
    assert gpus(db)[0] == (SHARED_GPU_HOLDER, 875) and available(db) == 1
    assert violations(db) == []
    back = db.run_write(
        lambda s: release_gone_quarantined(s, "n1", None, message="operator: node dead")
    )
    assert back == pytest.approx(0.875)
    assert gpus(db)[0] == (None, 0) and available(db) == 2
    assert violations(db) == []
