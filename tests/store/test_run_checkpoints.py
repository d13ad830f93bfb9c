"""An attempt's last checkpoint time: reported by its agent in heartbeats, stored on its row
(``job_runs.last_checkpoint_at``) for the authoritative attempt only, and read by the
scheduler's snapshot (``RunningJob.last_checkpoint_s``) and the displacement record."""

from __future__ import annotations

from datetime import datetime, timedelta

from gpufleet.policy.decisions import Preempt
from gpufleet.services import nodes, preemption
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from gpufleet.store.snapshot_cache import SnapshotCache
from gpufleet.store.tables import JobRunRow
from tests.factories import submit
from tests.store.test_displacements import reserve_one
from tests.store.test_gangs import confirm, fleet


def running(db: Database, gpus: int = 2) -> tuple[str, allocate.Reserved, int]:
    epoch = fleet(db, n=1)
    job_id = submit(db, "team-a", gpus=gpus).job_id
    r = reserve_one(db, job_id, "n1", gpus, epoch)
    confirm(db, r)
    return job_id, r, epoch


def beat(db: Database, job_id: str, r: allocate.Reserved, at_s: float, token: int = 0) -> None:
    listed = [nodes.HeartbeatRun(r.run_id, job_id, token or r.token, "RUNNING", at_s)]
    db.run_write(lambda s: nodes.heartbeat(s, "n1", 1, listed, nodes.NodeHealth()))


def stored(db: Database, run_id: str) -> datetime | None:
    with db.read() as s:
        return s.get(JobRunRow, run_id).last_checkpoint_at  # type: ignore[union-attr]


def now_of(db: Database) -> datetime:
    with db.read() as s:
        return db_now(s)


def test_a_heartbeat_records_the_checkpoint_time_and_the_snapshot_reads_it(
    db: Database,
) -> None:
    job_id, r, _ = running(db)
    assert stored(db, r.run_id) is None
    beat(db, job_id, r, 0.0)  # none reported
    assert stored(db, r.run_id) is None
    at = now_of(db) - timedelta(seconds=30)
    beat(db, job_id, r, at.timestamp())
    got = stored(db, r.run_id)
    assert got is not None and abs((got - at).total_seconds()) < 1e-3
    with db.snapshot() as s:
        now = db_now(s)
        (run,) = load_snapshot(s, now).running
        cache = SnapshotCache(full_every_s=1e9)
        (cached,) = cache.load(s, now, epoch=1).running
    assert run.last_checkpoint_s is not None
    assert abs(run.last_checkpoint_s - at.timestamp()) < 1e-3
    assert cached.last_checkpoint_s == run.last_checkpoint_s
    # a later checkpoint reaches the leader's cache incrementally (change_seq watches it)
    later = now_of(db) - timedelta(seconds=5)
    beat(db, job_id, r, later.timestamp())
    with db.snapshot() as s:
        (cached,) = cache.load(s, db_now(s), epoch=1).running
    assert not cache.stats.full
    assert cached.last_checkpoint_s is not None
    assert abs(cached.last_checkpoint_s - later.timestamp()) < 1e-3


def test_a_stale_token_does_not_write_it(db: Database) -> None:
    job_id, r, _ = running(db)
    beat(db, job_id, r, now_of(db).timestamp(), token=r.token + 1)
    assert stored(db, r.run_id) is None
    beat(db, job_id, r, now_of(db).timestamp(), token=r.token - 1 or 99)
    assert stored(db, r.run_id) is None


def test_it_never_moves_back_and_a_time_from_the_future_is_clamped_or_ignored(
    db: Database,
) -> None:
    job_id, r, _ = running(db)
    first = now_of(db) - timedelta(seconds=20)
    beat(db, job_id, r, first.timestamp())
    beat(db, job_id, r, (first - timedelta(seconds=10)).timestamp())  # older: kept as it is
    got = stored(db, r.run_id)
    assert got is not None and abs((got - first).total_seconds()) < 1e-3
    beat(db, job_id, r, (now_of(db) + timedelta(hours=1)).timestamp())  # beyond the skew
    assert stored(db, r.run_id) == got
    before = now_of(db)
    beat(db, job_id, r, (before + timedelta(seconds=30)).timestamp())  # within: the db's now
    clamped = stored(db, r.run_id)
    assert clamped is not None and before <= clamped <= now_of(db)
    beat(db, job_id, r, float("inf"))  # not a time: ignored, the heartbeat still answers
    assert stored(db, r.run_id) == clamped


def test_the_displacement_counts_the_work_since_the_last_checkpoint(db: Database) -> None:
    job_id, r, epoch = running(db, gpus=4)
    hour_ago = now_of(db) - timedelta(hours=1)
    db.run_write(
        lambda s: s.get(JobRunRow, r.run_id).__setattr__("started_at", hour_ago)  # type: ignore[union-attr]
    )
    beat(db, job_id, r, (now_of(db) - timedelta(minutes=6)).timestamp())
    big = submit(db, "team-a", gpus=8).job_id
    decision = Preempt(big, "n1", (r.run_id,), "defragment", gpu_count=8)
    db.run_write(
        lambda s: preemption.apply_preempt(
            s, decision, leader_holder="test-leader", leader_epoch=epoch
        )
    )
    with db.snapshot() as s:
        (d,) = load_snapshot(s, db_now(s)).recent_displacements
    assert d.job_id == job_id
    assert 4 * 6 / 60 - 0.01 <= d.gpu_hours <= 4 * 7 / 60  # 4 GPUs x ~6 min, not x 1 hour
