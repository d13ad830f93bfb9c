"""The leader's duration predictor on a real database (SQLite and PostgreSQL): warmed from the
successful attempts in ``usage_records``, refreshed with the ones that end later, and feeding
``predicted_duration_s`` of pending and running jobs in ``load_snapshot``."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.objectstore import ObjectStore
from gpufleet.services import auth, runs
from gpufleet.services.jobs import submit_job
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.predictions import HistoryPredictor
from gpufleet.store.queries import load_snapshot
from gpufleet.store.snapshot_cache import SnapshotCache, pending_of
from gpufleet.store.tables import ApiTokenRow, JobRow, JobRunRow
from tests.factories import become_leader, create_node
from tests.store.test_runs import write_manifest


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(str(tmp_path / "objects"))


class History:
    """Named jobs of one token, run through ``allocate.reserve`` and ``runs.complete_run``,
    each attempt backdated to the run time wanted."""

    def __init__(self, db: Database, store: ObjectStore) -> None:
        self.db, self.store = db, store
        db.run_write(
            lambda s: auth.create_token(s, "vision", name="alice", create_team_if_missing=True)
        )
        self.user = db.run_write(lambda s: s.scalars(select(ApiTokenRow.id)).one())
        create_node(db, "h1", gpus=8)
        self.epoch = become_leader(db, lease_s=3600)

    def submit(self, name: str = "train", gpus: int = 1) -> str:
        spec = JobSpec(("true",), Resources(gpus), PriorityClass.NORMAL, name=name)
        return submit_job(
            self.db,
            team_id="vision",
            idempotency_key=str(uuid.uuid4()),
            spec=spec,
            submitted_by=self.user,
        ).job_id

    def start(self, job_id: str, held_s: float) -> Any:
        def tx(s: Any) -> Any:
            gpus, epoch = s.execute(
                select(JobRow.gpu_count, JobRow.fencing_epoch).where(JobRow.id == job_id)
            ).one()
            r = allocate.reserve(
                s,
                job_id=job_id,
                node_id="h1",
                gpu_count=gpus,
                seen_fencing_epoch=epoch,
                leader_holder="test-leader",
                leader_epoch=self.epoch,
                lease_s=60,
                now=db_now(s),
            )
            at = s.get(JobRunRow, r.run_id).created_at
            s.execute(
                update(JobRunRow)
                .where(JobRunRow.id == r.run_id)
                .values(created_at=at - timedelta(seconds=held_s))
            )
            assert runs.confirm_assignment(s, r.run_id, r.token) == runs.Confirm.CONFIRMED
            return r

        return self.db.run_write(tx)

    def finish(self, job_id: str, r: Any, code: int = 0) -> None:
        uri = write_manifest(self.store, job_id, r.run_id, r.token, exit_code=code)
        rep = runs.Report("h1", r.run_id, r.token, runs.Outcome.EXITED, code, uri)
        assert runs.complete_run(self.db, self.store, rep)[0] == runs.CompletionResult.ACCEPTED

    def run(self, held_s: float, code: int = 0, name: str = "train") -> None:
        job_id = self.submit(name)
        self.finish(job_id, self.start(job_id, held_s), code)


def test_warm_refresh_and_snapshot(db: Database, store: ObjectStore) -> None:
    h = History(db, store)
    for held in (100.0, 200.0, 300.0, 400.0):
        h.run(held)
    h.run(50_000.0, code=1)  # failed: says nothing about how long the work takes
    pred = HistoryPredictor()
    assert db.run_write(pred.refresh) == 4
    got = pred.predict_s("vision", h.user, "train", 1)
    # the 0.8 quantile of ~100..400 s (each attempt also lived the test's own seconds)
    assert got is not None and 400.0 <= got < 400.0 + 120.0
    assert pred.predict_s("vision", h.user, "eval", 1) is not None  # coarser level: team+user+gpus
    assert pred.predict_s("nlp", None, "train", 1) is None
    # a run that ends later is read by the next refresh, and only it
    h.run(600.0)
    assert db.run_write(pred.refresh) == 1
    assert db.run_write(pred.refresh) == 0
    # the snapshot carries predictions for pending and running work
    waiting = h.submit()
    running = h.submit()
    h.start(running, 10.0)
    with db.snapshot() as s:
        snap = load_snapshot(s, db_now(s), predictions=pred)
    want = pred.predict_s("vision", h.user, "train", 1)
    assert {j.job_id: j.predicted_duration_s for j in snap.pending} == {waiting: want}
    assert [r.predicted_duration_s for r in snap.running if r.job_id == running] == [want]
    with db.snapshot() as s:
        plain = load_snapshot(s, db_now(s))
    assert all(j.predicted_duration_s is None for j in plain.pending)


def test_the_leaders_incremental_snapshot_carries_predictions(
    db: Database, store: ObjectStore
) -> None:
    """The scheduler reads through ``SnapshotCache``: it must fill the same predictions as
    ``load_snapshot`` and recompute the cached ones when the predictor learns."""
    h = History(db, store)
    for held in (100.0, 200.0, 300.0):
        h.run(held)
    pred = HistoryPredictor()
    db.run_write(pred.refresh)
    cache = SnapshotCache()
    waiting = h.submit()
    running = h.submit()
    h.start(running, 10.0)

    def both() -> tuple[dict[str, float | None], dict[str, float | None]]:
        with db.snapshot() as s:
            now = db_now(s)
            inc = cache.load(s, now, epoch=1, predictions=pred)
            full = load_snapshot(s, now, predictions=pred)
        for snap in (inc, full):
            assert snap.recent_displacements is not None
        got = {j.job_id: j.predicted_duration_s for j in pending_of(inc)}
        assert got == {j.job_id: j.predicted_duration_s for j in full.pending}
        ran = {r.job_id: r.predicted_duration_s for r in inc.running}
        assert ran == {r.job_id: r.predicted_duration_s for r in full.running}
        return got, ran

    first, ran = both()
    assert first[waiting] is not None and ran[running] == first[waiting]
    assert not cache.stats.full or cache.stats.reason == "first pass"
    for held in (5_000.0, 6_000.0, 7_000.0, 8_000.0):
        h.run(held)
    assert db.run_write(pred.refresh) == 4
    second, ran = both()
    assert not cache.stats.full  # an incremental pass, predictions recomputed in memory
    assert second[waiting] is not None and second[waiting] > first[waiting]
    assert ran[running] == second[waiting]
