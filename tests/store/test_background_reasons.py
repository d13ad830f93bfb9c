"""The controller's leader writes pending reasons and computes start estimates off the pass's
critical path (``Scheduler(background=True)``): the same rows must land as when the pass
writes them itself, in pass order, each job's "waiting" event once, and the estimate of one
pass is stored by a later one."""

from __future__ import annotations

from concurrent.futures import wait
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from gpufleet.controller.leadership import Leadership
from gpufleet.controller.scheduler import Scheduler
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow, SchedulingEventRow
from tests.factories import become_leader, create_node, create_team, submit

HOLDER = "background-test"


class Agent:
    def assign(self, _node_id: str, _address: str, _req: pb.AssignJobRequest) -> Any:
        return pb.AssignJobResponse(result=pb.AssignJobResponse.STARTED)


def _reasons(db: Database, jobs: list[str]) -> dict[str, Any]:
    with db.read() as s:
        rows = s.execute(select(JobRow.id, JobRow.pending_reason).where(JobRow.id.in_(jobs)))
        return dict(rows.all())


def test_background_reasons_land_as_the_in_pass_ones(db: Database, tmp_path: Path) -> None:
    create_team(db, "team-a")
    for i in range(2):
        create_node(db, f"n{i}", gpus=8)
    jobs = [submit(db, "team-a", gpus=8).job_id for _ in range(5)]
    epoch = become_leader(db, HOLDER, lease_s=3600)
    sched = Scheduler(
        db,
        ObjectStore(str(tmp_path / "objects")),
        Settings(data_dir=tmp_path),
        Leadership(HOLDER, epoch),
        Agent(),  # type: ignore[arg-type]
        background=True,
    )
    try:
        stats = sched.run_pass()
        assert stats.placed == 2
        waiting = [j for j in jobs if j not in {d.job_id for d in stats.applied}]
        assert sched._writing is not None  # the write went to the writer thread
        sched._join_writes()  # as the next pass does before it compares reasons
        first = _reasons(db, waiting)
        assert all(r is not None and r["code"] for r in first.values()), first
        assert all(r["start_estimate"] is None for r in first.values())  # not yet computed
        # the estimate of the first pass, computed meanwhile, is stored by the next pass
        assert sched._estimating is not None
        wait([sched._estimating[0]])
        sched.run_pass()
        sched._join_writes()
        second = _reasons(db, waiting)
        for job_id, r in second.items():
            assert r["code"] == first[job_id]["code"]
            assert r["start_estimate"] is not None, r
        with db.read() as s:
            events = s.execute(
                select(SchedulingEventRow.job_id, func.count())
                .where(SchedulingEventRow.kind == "waiting")
                .group_by(SchedulingEventRow.job_id)
            ).all()
        assert sorted(events) == sorted((j, 1) for j in waiting)
    finally:
        sched.close()
