"""A job known to signal its checkpoint: the latest ``checkpoint_handshake`` event of its
earlier attempts becomes ``RunningJob.handshake_saves_s`` of its running attempt, in the full
snapshot read and in the leader's cache alike (the victim cost reads it, ``policy.preemption``)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from gpufleet.services.run_completion import StopHandshake
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import handshake_savings, load_snapshot
from gpufleet.store.snapshot_cache import SnapshotCache
from gpufleet.store.transitions import record_event
from tests.store.test_run_checkpoints import running


def handshake(db: Database, job_id: str, h: StopHandshake) -> None:
    def write(s: Session) -> None:
        record_event(
            s,
            "checkpoint_handshake",
            now=db_now(s),
            message=h.describe(),
            job_id=job_id,
            details=h.details(),
        )

    db.run_write(write)


def saves(db: Database) -> tuple[float, float]:
    """(full read, fresh cache) ``handshake_saves_s`` of the one running attempt."""
    with db.snapshot() as s:
        now = db_now(s)
        (full,) = load_snapshot(s, now).running
        (cached,) = SnapshotCache(full_every_s=1e9).load(s, now, epoch=1).running
    return full.handshake_saves_s, cached.handshake_saves_s


def test_the_latest_signalled_stop_sets_the_saving(db: Database) -> None:
    job_id, _, _ = running(db)
    assert saves(db) == (0.0, 0.0)  # never stopped: a stop waits the whole grace
    handshake(db, job_id, StopHandshake(True, 30.0, 0.25, 29.75))
    assert saves(db) == (29.75, 29.75)  # it stops 0.25 s after SIGTERM, not 30 s
    # it ended by itself after signalling (saved_s 0): still known to signal, 2 s in
    handshake(db, job_id, StopHandshake(True, 30.0, 2.0, 0.0))
    assert saves(db) == (28.0, 28.0)
    handshake(db, job_id, StopHandshake(False, 30.0))  # its latest stop did not signal
    assert saves(db) == (0.0, 0.0)
    with db.read() as s:
        assert handshake_savings(s, [job_id, "no-such-job"]) == {}
