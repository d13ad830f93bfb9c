"""Recent displacements read back from the store (DD7 budget and anti-thrash window): a
Preempt applied through the live path records its ground on the stopped runs, and
``load_snapshot`` returns them as ``ClusterSnapshot.recent_displacements``."""

from __future__ import annotations

from gpufleet.policy.decisions import Preempt
from gpufleet.services import preemption
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from tests.factories import submit
from tests.store.test_gangs import confirm, fleet


def reserve_one(
    db: Database, job_id: str, node_id: str, gpus: int, epoch: int
) -> allocate.Reserved:
    return db.run_write(
        lambda s: allocate.reserve(
            s,
            job_id=job_id,
            node_id=node_id,
            gpu_count=gpus,
            seen_fencing_epoch=0,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
        )
    )


def test_a_defragment_preemption_is_read_back_with_its_ground(db: Database) -> None:
    epoch = fleet(db, n=1)
    small = [submit(db, "team-a", gpus=2).job_id for _ in range(2)]
    runs = [reserve_one(db, j, "n1", 2, epoch) for j in small]
    for r in runs:
        confirm(db, r)
    big = submit(db, "team-a", gpus=8).job_id
    with db.snapshot() as s:
        assert load_snapshot(s, db_now(s)).recent_displacements == ()
    victims = tuple(sorted(r.run_id for r in runs))
    decision = Preempt(big, "n1", victims, "defragment", gpu_count=8)
    db.run_write(
        lambda s: preemption.apply_preempt(
            s, decision, leader_holder="test-leader", leader_epoch=epoch
        )
    )
    with db.snapshot() as s:
        now = db_now(s)
        got = load_snapshot(s, now).recent_displacements
        assert got is not None
        assert sorted(d.job_id for d in got) == sorted(small)
        assert {d.reason for d in got} == {"defragment"}
        assert all(0.0 <= d.gpu_hours < 2 * 60 / 3600.0 for d in got)  # 2 GPUs, < 1 min
        assert all(abs(d.at_s - now.timestamp()) < 60.0 for d in got)
        # outside the window: gone
        assert load_snapshot(s, now, displacement_window_s=-120.0).recent_displacements == ()
