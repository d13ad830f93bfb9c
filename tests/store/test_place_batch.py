"""One pass's placements on different nodes are reserved concurrently
(``Scheduler._place_batch``, PostgreSQL): the pass used to make one round trip after another,
and at 300 hollow nodes spent ~25 ms per placement waiting. Concurrency must change nothing
that a pass guarantees: every placement is its own reservation, no GPU is in two, a conflict
skips only its own placement, each placed run is dispatched once in decision order, and a
lost lease stops the pass with nothing placed after it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from gpufleet.controller.leadership import Leadership
from gpufleet.controller.scheduler import Scheduler
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.queries import check_database
from gpufleet.store.tables import JobRow, JobRunRow, LeaderLeaseRow
from tests.factories import become_leader, create_node, create_team, submit

HOLDER = "batch-test"


class Agent:
    def assign(self, node_id: str, address: str, req: pb.AssignJobRequest) -> Any:
        return pb.AssignJobResponse(result=pb.AssignJobResponse.STARTED)


def _scheduler(db: Database, tmp_path: Path, epoch: int) -> tuple[Scheduler, list[str]]:
    sched = Scheduler(
        db,
        ObjectStore(str(tmp_path / "objects")),
        Settings(data_dir=tmp_path),
        Leadership(HOLDER, epoch),
        Agent(),  # type: ignore[arg-type]
    )
    dispatched: list[str] = []
    sched._pool.shutdown(wait=True)
    sched._pool = type(sched._pool)(max_workers=1)
    sched._pool.submit = lambda _fn, run_id: dispatched.append(run_id)  # type: ignore[method-assign,assignment,misc]
    return sched, dispatched


def test_a_pass_reserves_placements_on_many_nodes_each_once(db: Database, tmp_path: Path) -> None:
    create_team(db, "team-a")
    for i in range(12):
        create_node(db, f"n{i:02d}", gpus=8)
    # 12 x 8 GPUs; 30 jobs of 1/2/4 GPUs (several per node); 2 that cannot fit anywhere now
    sizes = [1, 2, 4] * 10
    jobs = [submit(db, "team-a", gpus=g).job_id for g in sizes]
    cancelled = jobs[7]
    sched, dispatched = _scheduler(db, tmp_path, become_leader(db, HOLDER, lease_s=3600))
    # a cancel that lands between the pass's snapshot and its reservations: only that
    # placement is skipped (the job guard in the reservation), the others all commit
    real_load = sched._snapshots.load

    def load_then_cancel(*a: Any, **k: Any) -> Any:
        snap = real_load(*a, **k)
        db.run_write(
            lambda s: s.execute(
                update(JobRow).where(JobRow.id == cancelled).values(cancel_requested=True)
            )
        )
        return snap

    sched._snapshots.load = load_then_cancel  # type: ignore[method-assign]
    stats = sched.run_pass()
    assert stats.placed == len(jobs) - 1 and stats.conflicts == 1
    with db.read() as s:
        runs = s.execute(select(JobRunRow.id, JobRunRow.job_id, JobRunRow.node_id)).all()
    assert sorted(r.job_id for r in runs) == sorted(j for j in jobs if j != cancelled)
    assert len({r.node_id for r in runs}) > 1
    assert dispatched == stats.placed_runs and sorted(dispatched) == sorted(r.id for r in runs)
    assert check_database(db)[1] == []


def test_a_lease_lost_during_the_pass_places_nothing_more(db: Database, tmp_path: Path) -> None:
    create_team(db, "team-a")
    for i in range(6):
        create_node(db, f"n{i}", gpus=8)
    jobs = [submit(db, "team-a", gpus=8).job_id for _ in range(6)]
    epoch = become_leader(db, HOLDER, lease_s=3600)
    sched, dispatched = _scheduler(db, tmp_path, epoch)
    real_load = sched._snapshots.load

    def load_then_lose(*a: Any, **k: Any) -> Any:
        snap = real_load(*a, **k)
        # another controller took the lease after the snapshot
        db.run_write(
            lambda s: s.execute(
                update(LeaderLeaseRow).values(holder="other", epoch=LeaderLeaseRow.epoch + 1)
            )
        )
        return snap

    sched._snapshots.load = load_then_lose  # type: ignore[method-assign]
    stats = sched.run_pass()
    assert stats.placed == 0 and dispatched == []
    assert sched.leadership.epoch == 0
    with db.read() as s:
        assert s.scalars(select(JobRunRow.id)).all() == []
        statuses = set(s.scalars(select(JobRow.status).where(JobRow.id.in_(jobs))))
    assert statuses == {"PENDING"}
