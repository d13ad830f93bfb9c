"""Leader failover (seed DD6): two controllers on one database; only the lease holder places
work; when it dies without giving the lease back, the other takes it with a higher epoch after
expiry, and the old leader's writes are refused inside the transaction."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest

from gpufleet.controller.main import Controller
from gpufleet.domain.errors import NotLeader
from gpufleet.processes import ensure_fleet_ca
from gpufleet.queue import InProcWaker
from gpufleet.services import nodes
from gpufleet.settings import Settings
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow
from tests.factories import create_node, create_team, submit
from tests.ports import free_port

pytestmark = pytest.mark.slow


def controller(db: Database, tmp: Path) -> Controller:
    settings = Settings(
        data_dir=tmp,
        leader_lease_s=1.5,
        scheduler_tick_s=0.2,
        controller_address=f"127.0.0.1:{free_port()}",
        join_address=f"127.0.0.1:{free_port()}",
    )
    ensure_fleet_ca(settings)
    return Controller(settings, db, InProcWaker())


def test_standby_takes_over_with_a_higher_epoch_and_fences_the_old_leader(
    db: Database, tmp_path: Path
) -> None:
    create_team(db)
    create_node(db, "n1", gpus=8)  # an unreachable agent address: assignments just fail
    first, second = controller(db, tmp_path), controller(db, tmp_path)
    first.start()
    second.start()
    try:
        assert first.leadership.epoch >= 1
        assert second.leadership.epoch == 0
        old_epoch = first.leadership.epoch
        # the leader "crashes": its loops stop and it never gives the lease back
        first._stop.set()
        deadline = time.monotonic() + 10
        while second.leadership.epoch == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert second.leadership.epoch == old_epoch + 1
        # the new leader places work on n1 once it hears from it (a heartbeat recorded after
        # its start, by any replica)
        db.run_write(lambda s: nodes.heartbeat(s, "n1", agent_epoch=1, running=[]))
        job = submit(db, gpus=2).job_id
        second.waker.wake()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with db.read() as s:
                if s.get(JobRow, job).status != "PENDING":
                    break
            time.sleep(0.1)
        with db.read() as s:
            assert s.get(JobRow, job).status == "SCHEDULED"
        # a write by the old leader (still believing its epoch) is refused in the transaction
        late = submit(db, gpus=1).job_id
        with pytest.raises(NotLeader):
            db.run_write(
                partial(
                    allocate.reserve,
                    job_id=late,
                    node_id="n1",
                    gpu_count=1,
                    seen_fencing_epoch=0,
                    leader_holder=first.leadership.holder,
                    leader_epoch=old_epoch,
                    lease_s=60,
                )
            )
    finally:
        second.stop()
        first.stop()
