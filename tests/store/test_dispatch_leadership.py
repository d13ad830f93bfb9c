"""An AssignJob is sent only while this controller leads, with the epoch it leads under.

Found by the hollow-node fleet run: with 300 nodes heartbeating, a lease renewal ran late,
``leadership.epoch`` was 0 for a moment, and the assign pool sent AssignJob with
``leader_epoch=0``. The agent, which had heard epoch 1, refused it as stale and tombstoned the
run; the controller then recorded a failed start and the job was charged for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpufleet.controller.leadership import Leadership
from gpufleet.controller.scheduler import Scheduler
from gpufleet.domain.states import RunStatus
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow, JobRunRow
from tests.factories import become_leader, create_node, create_team, submit

HOLDER = "dispatch-test"


class EpochCheckingAgent:
    """The agent's side of AssignJob as the real agent answers it: an epoch below the
    highest one heard is refused as stale (agent/core.py)."""

    def __init__(self, heard: int) -> None:
        self.heard = heard
        self.sent: list[pb.AssignJobRequest] = []

    def assign(self, node_id: str, address: str, req: pb.AssignJobRequest) -> Any:
        self.sent.append(req)
        if req.leader_epoch < self.heard:
            return pb.AssignJobResponse(
                result=pb.AssignJobResponse.REJECTED_STALE,
                message=f"stale leader epoch {req.leader_epoch} < {self.heard}",
            )
        return pb.AssignJobResponse(result=pb.AssignJobResponse.STARTED)


def _placed(db: Database, tmp_path: Path) -> tuple[Scheduler, Leadership, EpochCheckingAgent, str]:
    create_team(db, "team-a")
    create_node(db, "n1", gpus=8)
    job_id = submit(db, "team-a", gpus=2).job_id
    epoch = become_leader(db, HOLDER, lease_s=3600)
    leadership = Leadership(HOLDER, epoch)
    agent = EpochCheckingAgent(heard=epoch)
    sched = Scheduler(
        db,
        ObjectStore(str(tmp_path / "objects")),
        Settings(data_dir=tmp_path),
        leadership,
        agent,  # type: ignore[arg-type]
    )
    sched._pool.shutdown(wait=True)  # dispatch by hand below, not from the pass
    sched._pool = type(sched._pool)(max_workers=1)
    sched._pool.submit = lambda *_a, **_k: None  # type: ignore[method-assign,assignment]
    assert sched.run_pass().placed == 1
    with db.read() as s:
        job = s.get(JobRow, job_id)
        assert job is not None and job.current_run_id is not None
        return sched, leadership, agent, job.current_run_id


def _run_status(db: Database, run_id: str) -> str:
    with db.read() as s:
        run = s.get(JobRunRow, run_id)
        assert run is not None
        return str(run.status)


def test_no_assignjob_while_the_lease_renewal_has_failed(db: Database, tmp_path: Path) -> None:
    sched, leadership, agent, run_id = _placed(db, tmp_path)
    epoch = leadership.epoch
    leadership.epoch = 0  # a renewal failed (controller/main.py sets 0)
    sched.dispatch(run_id)
    assert agent.sent == []
    assert _run_status(db, run_id) == RunStatus.ASSIGNED  # not a failed start

    leadership.epoch = epoch  # the renewal succeeded again: the reconciler's re-send
    sched.dispatch(run_id)
    assert [r.leader_epoch for r in agent.sent] == [epoch]
    assert _run_status(db, run_id) == RunStatus.ASSIGNED  # STARTED: its confirm records it


def test_no_assignjob_once_the_lease_ran_out_on_this_host(db: Database, tmp_path: Path) -> None:
    sched, leadership, agent, run_id = _placed(db, tmp_path)
    leadership.lease_deadline = time.monotonic() - 1  # the last renewal's lease is over
    sched.dispatch(run_id)
    assert agent.sent == []
    assert _run_status(db, run_id) == RunStatus.ASSIGNED
