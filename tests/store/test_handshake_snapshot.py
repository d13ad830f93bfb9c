"""A job known to signal its checkpoint: the latest ``checkpoint_handshake`` event of its
earlier attempts becomes ``RunningJob.handshake_saves_s`` of its running attempt, in the full
snapshot read and in the leader's cache alike (the victim cost reads it, ``policy.preemption``).
Each stop goes the live path: a Preempt applied, the agent's STOPPED report with its
handshake (``services.run_completion`` records the event), and a new attempt placed."""

from __future__ import annotations

from dataclasses import replace

from gpufleet.objectstore import ObjectStore
from gpufleet.policy.decisions import Preempt
from gpufleet.services import preemption, runs
from gpufleet.services.run_completion import StopHandshake
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import handshake_savings, load_snapshot
from gpufleet.store.snapshot_cache import SnapshotCache
from tests.factories import submit
from tests.store.test_gangs import confirm, fleet, stopped


def place(db: Database, job_id: str, epoch: int, seen: int) -> allocate.Reserved:
    r = db.run_write(
        lambda s: allocate.reserve(
            s,
            job_id=job_id,
            node_id="n1",
            gpu_count=2,
            seen_fencing_epoch=seen,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
        )
    )
    confirm(db, r)
    return r


def stop(db: Database, r: allocate.Reserved, for_job: str, epoch: int, h: StopHandshake) -> None:
    """Preempt ``r`` for ``for_job`` and report it STOPPED with handshake ``h``."""
    decision = Preempt(for_job, "n1", (r.run_id,), "priority", gpu_count=2)
    db.run_write(
        lambda s: preemption.apply_preempt(
            s, decision, leader_holder="test-leader", leader_epoch=epoch
        )
    )
    report = replace(stopped(r), stop_handshake=h)
    result, msg = runs.complete_run(db, ObjectStore("/nonexistent"), report)
    assert result is runs.CompletionResult.ACCEPTED, msg


def saves(db: Database) -> tuple[float, float]:
    """(full read, fresh cache) ``handshake_saves_s`` of the one running attempt."""
    with db.snapshot() as s:
        now = db_now(s)
        (full,) = load_snapshot(s, now).running
        (cached,) = SnapshotCache(full_every_s=1e9).load(s, now, epoch=1).running
    return full.handshake_saves_s, cached.handshake_saves_s


def test_the_latest_signalled_stop_sets_the_saving(db: Database) -> None:
    epoch = fleet(db, n=1)
    job_id = submit(db, "team-a", gpus=2).job_id
    other = submit(db, "team-a", gpus=8).job_id  # the preemptor named by each stop
    r = place(db, job_id, epoch, seen=0)
    assert saves(db) == (0.0, 0.0)  # never stopped: a stop waits the whole grace
    stop(db, r, other, epoch, StopHandshake(True, 30.0, 0.25, 29.75))
    r = place(db, job_id, epoch, seen=1)
    assert saves(db) == (29.75, 29.75)  # it stops 0.25 s after SIGTERM, not 30 s
    # it ended by itself after signalling (saved_s 0): still known to signal, 2 s in
    stop(db, r, other, epoch, StopHandshake(True, 30.0, 2.0, 0.0))
    r = place(db, job_id, epoch, seen=2)
    assert saves(db) == (28.0, 28.0)
    stop(db, r, other, epoch, StopHandshake(False, 30.0))  # its latest stop did not signal
    place(db, job_id, epoch, seen=3)
    assert saves(db) == (0.0, 0.0)
    with db.read() as s:
        assert handshake_savings(s, [job_id, "no-such-job"]) == {}
