"""Silence is counted only while a controller listens (docs/design/lifecycle.md): the
failure detector of a leader that just started gives every node fence timeout + one
heartbeat interval from its own start before it fences it, and its scheduler places nothing
on a node it has not heard from. Real database (SQLite and PostgreSQL), the controller's own
reconciler and scheduler; heartbeats are written as the servicer writes them (the column),
backdated on the database clock instead of waiting."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from gpufleet.controller.agents import AgentClients
from gpufleet.controller.leadership import Leadership
from gpufleet.controller.reconciler import Reconciler
from gpufleet.controller.scheduler import Scheduler
from gpufleet.objectstore import ObjectStore
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import JobRunRow, NodeRow
from tests.factories import become_leader, create_node, create_team, submit

HOLDER = "liveness-test-leader"


def _now(db: Database) -> datetime:
    with db.read() as s:
        return db_now(s)


def _heard(db: Database, node_id: str, ago_s: float) -> None:
    """The node's last heartbeat was ``ago_s`` seconds ago (database clock)."""
    db.run_write(
        lambda s: s.execute(
            update(NodeRow)
            .where(NodeRow.id == node_id)
            .values(last_heartbeat_at=db_now(s) - timedelta(seconds=ago_s))
        )
    )


def _status(db: Database, node_id: str) -> str:
    with db.read() as s:
        node = s.get(NodeRow, node_id)
        assert node is not None
        return str(node.status)


def _settings(tmp: Path) -> Settings:
    return Settings(
        data_dir=tmp, heartbeat_interval_s=1.0, suspect_after_missed=3, fence_timeout_s=4.0
    )


def test_a_new_leader_counts_silence_from_its_own_start(db: Database, tmp_path: Path) -> None:
    """A node silent for 100 s (the control plane was down) is neither suspected nor fenced
    by a leader that started 2 s ago; it is SUSPECT once the leader has listened for the
    suspect window + one interval (4 s), and fenced only after fence timeout + one interval
    (5 s) of the leader's own listening."""
    create_node(db, "n1")
    _heard(db, "n1", 100)
    lead = Leadership(HOLDER, become_leader(db, HOLDER), listening_since=None)
    reconciler = Reconciler(db, _settings(tmp_path), lead, dispatch=lambda _run: None)

    lead.listening_since = _now(db) - timedelta(seconds=2)
    reconciler.run_pass()
    reconciler.run_pass()
    assert _status(db, "n1") == "HEALTHY"

    lead.listening_since = _now(db) - timedelta(seconds=4.5)
    reconciler.run_pass()
    reconciler.run_pass()
    assert _status(db, "n1") == "SUSPECT"

    lead.listening_since = _now(db) - timedelta(seconds=5.5)
    reconciler.run_pass()
    assert _status(db, "n1") == "QUARANTINED"


def test_a_live_leader_still_fences_at_the_fence_timeout(db: Database, tmp_path: Path) -> None:
    """A leader that has listened for an hour: 3.5 s of silence -> SUSPECT, not fenced;
    4.5 s (past the fence timeout) -> fenced, as before."""
    create_node(db, "n1")
    create_node(db, "n2")
    lead = Leadership(HOLDER, become_leader(db, HOLDER))
    lead.listening_since = _now(db) - timedelta(hours=1)
    reconciler = Reconciler(db, _settings(tmp_path), lead, dispatch=lambda _run: None)
    _heard(db, "n1", 3.5)
    _heard(db, "n2", 4.5)
    reconciler.run_pass()
    reconciler.run_pass()
    assert _status(db, "n1") == "SUSPECT"
    assert _status(db, "n2") == "QUARANTINED"


def test_a_new_leader_places_nothing_on_a_node_it_has_not_heard(
    db: Database, tmp_path: Path
) -> None:
    """n2 (4 GPUs) is the best fit of a 2-GPU job, but its last heartbeat is older than the
    leader's start: the job goes to n1, heard since. Once n2's heartbeat is recorded
    (by any replica), n2 gets the next job."""
    create_team(db)
    create_node(db, "n1", gpus=8)
    create_node(db, "n2", gpus=4)
    _heard(db, "n2", 2.0)
    lead = Leadership(HOLDER, become_leader(db, HOLDER))
    lead.listening_since = _now(db) - timedelta(seconds=1)
    _heard(db, "n1", 0.0)
    settings = _settings(tmp_path)
    scheduler = Scheduler(
        db, ObjectStore(str(tmp_path / "objects")), settings, lead, AgentClients()
    )
    try:
        first = submit(db, gpus=2).job_id
        assert scheduler.run_pass().placed == 1
        _heard(db, "n2", 0.0)
        second = submit(db, gpus=2).job_id
        assert scheduler.run_pass().placed == 1
        with db.read() as s:
            placed = dict(s.execute(select(JobRunRow.job_id, JobRunRow.node_id)).all())
        assert placed == {first: "n1", second: "n2"}
    finally:
        scheduler.close()


def test_a_leader_whose_renewal_hangs_past_its_lease_stops_leading(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease renewal hangs (a host cut off from the database: the call returns only when
    the link is back): from the lease's end this controller is not leader, so a silent node
    is not suspected by it; once a renewal succeeds in time it leads again, counting silence
    from that renewal (the nodes were unheard by it meanwhile)."""
    from gpufleet.controller.main import Controller
    from gpufleet.queue import InProcWaker

    settings = _settings(tmp_path).model_copy(update={"leader_lease_s": 0.6})
    ctl = Controller(settings, db, InProcWaker(), insecure=True)
    ctl._acquire_once()
    lead = ctl.leadership
    first_epoch, first_listening = lead.epoch, lead.listening_since
    assert lead.is_leader and first_epoch > 0 and first_listening is not None

    create_node(db, "n1")
    _heard(db, "n1", 100)
    lead.listening_since = _now(db) - timedelta(hours=1)  # it has listened for long
    reconciler = Reconciler(db, settings, lead, dispatch=lambda _run: None)

    real_write = db.run_write
    release = threading.Event()

    def hung_write(fn: Any, *args: Any, **kwargs: Any) -> Any:
        release.wait(10)
        return real_write(fn, *args, **kwargs)

    monkeypatch.setattr(db, "run_write", hung_write)
    renewal = threading.Thread(target=ctl._acquire_once)
    renewal.start()
    time.sleep(0.8)  # past the 0.6 s lease, the renewal still hanging
    assert not lead.is_leader
    monkeypatch.setattr(db, "run_write", real_write)  # the reconciler's writes go through
    reconciler.run_pass()
    assert _status(db, "n1") == "HEALTHY"  # a controller past its lease suspects nobody

    monkeypatch.setattr(db, "run_write", hung_write)
    release.set()
    renewal.join(timeout=10)
    monkeypatch.setattr(db, "run_write", real_write)
    # the late renewal's lease is counted from the call's start: already over
    assert not lead.is_leader
    ctl._acquire_once()  # the loop's next renewal, on time
    assert lead.is_leader and lead.epoch >= first_epoch  # (its lease had expired: a new epoch)
    assert lead.listening_since is not None and lead.listening_since > first_listening
    reconciler.run_pass()
    assert _status(db, "n1") == "HEALTHY"  # silence counted from the late renewal
