"""The leader's incremental snapshot (``store.snapshot_cache``) equals a full read
(``store.queries.load_snapshot``) after any sequence of writes, on SQLite and real PostgreSQL:
submits, cancels, placements, confirmations, completions, preemptions, priority changes and
node changes. And it falls back to full reads whenever it cannot trust the change sequence."""

from __future__ import annotations

import contextlib
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text

from gpufleet.domain.errors import (
    CapacityConflict,
    Conflict,
    IllegalTransition,
    NotFound,
    StaleState,
    ValidationFailed,
)
from gpufleet.domain.states import JobStatus, NodeStatus, RunStatus
from gpufleet.domain.types import GpuDevice, JobSpec, PriorityClass, Resources
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Preempt
from gpufleet.policy.fleet_index import FleetIndex
from gpufleet.policy.priority import sorted_queues
from gpufleet.policy.snapshot import ClusterSnapshot
from gpufleet.services import jobctl, nodes, preemption, runs
from gpufleet.services.jobs import cancel_job, submit_job
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from gpufleet.store.snapshot_cache import WATCHED, SnapshotCache
from gpufleet.store.tables import JobRow, JobRunRow, NodeCapacityRow
from tests.factories import become_leader, create_node, create_team, submit
from tests.store.test_runs import write_manifest

CONFIG = PolicyConfig()


def normalized(snap: ClusterSnapshot) -> dict[str, Any]:
    """A snapshot in a form that does not depend on row order (fair-share usage compared
    separately: summing the same floats in another order may differ in the last bit)."""
    queues = (
        {t: tuple(q) for t, q in snap.queues.items()}
        if snap.queues is not None
        else {t: tuple(q) for t, q in sorted_queues(snap.pending, CONFIG).items()}
    )
    return {
        "now_s": snap.now_s,
        "nodes": sorted(snap.nodes, key=lambda n: n.node_id),
        "queues": queues,
        "running": sorted(snap.running, key=lambda r: r.run_id),
        "teams": {
            t: (s.weight, s.guaranteed_gpus, s.borrow_limit_gpus) for t, s in snap.teams.items()
        },
        "holds": snap.holds,
    }


def assert_indexed(snap: ClusterSnapshot) -> None:
    """The cache's FleetIndex, kept across refreshes, describes exactly ``snap.nodes``: the
    free lists, the kept label buckets and the static facts of one built from scratch."""
    kept = snap.fleet_index
    assert kept is not None
    fresh = FleetIndex(snap.nodes)
    assert list(kept.nodes.items()) == list(fresh.nodes.items())
    assert {t: keys for t, keys in kept.lists.items() if keys} == fresh.lists
    assert {t: n for t, n in kept.free_by_type.items() if n} == fresh.free_by_type
    for t, label in kept.buckets:
        fresh.bucket(t, label)
        assert {v: keys for v, keys in kept.buckets[(t, label)].items() if keys} == (
            fresh.buckets[(t, label)]
        )
    k, f = kept.static, fresh.static
    assert (k.capacity_gpus, k.capacity_cpu, k.capacity_memory_mb, k.n_schedulable) == (
        f.capacity_gpus,
        f.capacity_cpu,
        f.capacity_memory_mb,
        f.n_schedulable,
    )
    assert [(n.node_id, every, sched) for n, every, sched in k.shape_counts(True)] == [
        (n.node_id, every, sched) for n, every, sched in f.shape_counts(True)
    ]


def assert_same(incremental: ClusterSnapshot, full: ClusterSnapshot) -> None:
    assert normalized(incremental) == normalized(full)
    assert_indexed(incremental)
    for team, state in full.teams.items():
        assert math.isclose(
            incremental.teams[team].usage_gpu_s, state.usage_gpu_s, rel_tol=1e-9, abs_tol=1e-6
        )


def compare(db: Database, cache: SnapshotCache, epoch: int = 1) -> ClusterSnapshot:
    """Refresh ``cache`` and read a full snapshot in the same database snapshot; both must
    be equal."""
    with db.snapshot() as s:
        now = db_now(s)
        inc = cache.load(s, now, epoch=epoch)
        full = load_snapshot(s, now)
    assert_same(inc, full)
    return inc


class World:
    """Drives random writes through the services the platform uses."""

    def __init__(self, db: Database, store: ObjectStore, epoch: int, rng: random.Random) -> None:
        self.db, self.store, self.epoch, self.rng = db, store, epoch, rng

    def _ids(self, query: Any) -> list[Any]:
        with self.db.read() as s:
            return list(s.execute(query).all())

    def pick(self, query: Any) -> Any | None:
        rows = self._ids(query)
        return self.rng.choice(rows) if rows else None

    def submit(self) -> None:
        submit(
            self.db,
            team=self.rng.choice(["team-a", "team-b"]),
            gpus=self.rng.choice([1, 2, 4, 8]),
            priority=self.rng.choice(["LOW", "NORMAL", "HIGH"]),
            max_retries=self.rng.choice([0, 2]),
        )

    def submit_gang(self) -> None:
        per_node = self.rng.choice([2, 4])
        spec = JobSpec(
            command=("true",),
            resources=Resources(2 * per_node, nodes=2, gpus_per_node=per_node),
            priority=PriorityClass(self.rng.choice(["LOW", "NORMAL"])),
            max_retries=self.rng.choice([0, 2]),
        )
        submit_job(self.db, team_id="team-a", idempotency_key=str(uuid.uuid4()), spec=spec)

    def place_gang(self) -> None:
        job = self.pick(
            select(JobRow.id, JobRow.gpu_count, JobRow.fencing_epoch).where(
                JobRow.status == JobStatus.PENDING,
                JobRow.cancel_requested.is_(False),
                JobRow.spec["resources"]["nodes"].as_integer() == 2,
            )
        )
        ids = [r.node_id for r in self._ids(select(NodeCapacityRow.node_id))]
        if job is None or len(ids) < 2:
            return
        a, b = self.rng.sample(ids, 2)
        half = job.gpu_count // 2
        self.db.run_write(
            lambda s: allocate.reserve_gang(
                s,
                job_id=job.id,
                members=[(0, a, half), (1, b, half)],
                seen_fencing_epoch=job.fencing_epoch,
                leader_holder="test-leader",
                leader_epoch=self.epoch,
                lease_s=60,
            )
        )

    def cancel(self) -> None:
        row = self.pick(
            select(JobRow.id).where(
                JobRow.status.in_([JobStatus.PENDING, JobStatus.SCHEDULED, JobStatus.RUNNING])
            )
        )
        if row is not None:
            cancel_job(self.db, None, row.id)

    def place(self) -> None:
        job = self.pick(
            select(JobRow.id, JobRow.gpu_count, JobRow.fencing_epoch).where(
                JobRow.status == JobStatus.PENDING,
                JobRow.cancel_requested.is_(False),
                JobRow.spec["resources"]["nodes"].as_integer().is_(None),
            )
        )
        node = self.pick(select(NodeCapacityRow.node_id))
        if job is None or node is None:
            return
        self.db.run_write(
            lambda s: allocate.reserve(
                s,
                job_id=job.id,
                node_id=node.node_id,
                gpu_count=job.gpu_count,
                seen_fencing_epoch=job.fencing_epoch,
                leader_holder="test-leader",
                leader_epoch=self.epoch,
                lease_s=60,
            )
        )

    def confirm(self) -> None:
        run = self.pick(
            select(JobRunRow.id, JobRunRow.token).where(JobRunRow.status == RunStatus.ASSIGNED)
        )
        if run is not None:
            self.db.run_write(lambda s: runs.confirm_assignment(s, run.id, run.token, 100))

    def complete(self) -> None:
        run = self.pick(
            select(JobRunRow.id, JobRunRow.job_id, JobRunRow.token, JobRunRow.node_id).where(
                JobRunRow.status.in_([RunStatus.RUNNING, RunStatus.PREEMPTING])
            )
        )
        if run is None:
            return
        code = self.rng.choice([0, 1])
        uri = write_manifest(self.store, run.job_id, run.id, run.token, code)
        outcome = self.rng.choice([runs.Outcome.EXITED, runs.Outcome.STOPPED])
        report = runs.Report(run.node_id, run.id, run.token, outcome, code, uri)
        # a zero backoff: a retried job is back in the queue at once, or a few ms later
        runs.complete_run(self.db, self.store, report, retry_backoff=(0.0, 0.0))

    def preempt(self) -> None:
        victim = self.pick(
            select(JobRunRow.id, JobRunRow.node_id, JobRunRow.gpu_ids).where(
                JobRunRow.status.in_([RunStatus.ASSIGNED, RunStatus.RUNNING])
            )
        )
        job = self.pick(
            select(JobRow.id).where(
                JobRow.status == JobStatus.PENDING, JobRow.cancel_requested.is_(False)
            )
        )
        if victim is None or job is None:
            return
        decision = Preempt(job.id, victim.node_id, (victim.id,), "priority", len(victim.gpu_ids))
        self.db.run_write(
            lambda s: preemption.apply_preempt(
                s, decision, leader_holder="test-leader", leader_epoch=self.epoch
            )
        )

    def release_holds(self) -> None:
        self.db.run_write(lambda s: preemption.release_holds(s, []))

    def patch(self) -> None:
        statuses = self.rng.choice([["PENDING"], ["SCHEDULED", "RUNNING"]])
        job = self.pick(select(JobRow.id).where(JobRow.status.in_(statuses)))
        if job is not None:
            pending = statuses == ["PENDING"]
            patch = jobctl.JobPatch(
                priority=self.rng.choice(["LOW", "NORMAL", "HIGH"]),
                max_runtime_s=self.rng.choice([None, 3600.0]),
                # a PENDING job's GPUs may change too (why --suggest, migration 0012_day26)
                gpu_count=self.rng.choice([None, 1, 2]) if pending else None,
                gpu_types=self.rng.choice([None, [], ["H100"]]) if pending else None,
            )
            try:
                self.db.run_write(lambda s: jobctl.patch_job(s, None, job.id, patch))
            except ValidationFailed:  # a gang's size (nodes x gpus_per_node) does not change
                keep = replace(patch, gpu_count=None)
                self.db.run_write(lambda s: jobctl.patch_job(s, None, job.id, keep))

    def node_status(self) -> None:
        node = self.pick(select(NodeCapacityRow.node_id))
        if node is not None:
            to = self.rng.choice([NodeStatus.CORDONED, NodeStatus.HEALTHY, NodeStatus.DRAINING])
            self.db.run_write(lambda s: nodes.set_node_status(s, node.node_id, to, message="test"))

    def node_register(self) -> None:
        """A new node, or a re-registration with other labels."""
        node_id = f"n{self.rng.randrange(6)}"
        inv = nodes.NodeInventory(
            node_id=node_id,
            address="127.0.0.1:1",
            agent_epoch=1,
            gpus=tuple(GpuDevice(i, f"{node_id}-{i}", "H100", 81920) for i in range(8)),
            cpu=64,
            memory_mb=512_000,
            labels={"rack": self.rng.choice(["r1", "r2"])},
            inventory_source="declared",
        )
        self.db.run_write(lambda s: nodes.register_node(s, inv))

    def heartbeat_only(self) -> None:
        """A write the snapshot does not read (no change_seq bump needed)."""
        self.db.run_write(lambda s: s.execute(text("UPDATE nodes SET last_heartbeat_at = NULL")))

    OPS: tuple[str, ...] = (
        "submit_gang",
        "place_gang",
        "place_gang",
        "submit",
        "submit",
        "submit",
        "cancel",
        "place",
        "place",
        "place",
        "confirm",
        "confirm",
        "complete",
        "complete",
        "patch",
        "preempt",
        "release_holds",
        "patch",
        "node_status",
        "node_register",
        "heartbeat_only",
    )

    def do(self, op: str) -> None:
        fn: Callable[[], None] = getattr(self, op)
        # a random op that does not apply (e.g. a full node) leaves the state unchanged
        with contextlib.suppress(
            CapacityConflict, Conflict, IllegalTransition, NotFound, StaleState
        ):
            fn()


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(str(tmp_path / "objects"))


def world(db: Database, store: ObjectStore, seed: int = 0) -> World:
    create_team(db, "team-a")
    create_team(db, "team-b")
    for i in range(3):
        create_node(db, f"n{i}")
    return World(db, store, become_leader(db), random.Random(seed))


class TestIncrementalEqualsFull:
    @settings(
        max_examples=12,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(ops=st.lists(st.sampled_from(World.OPS), min_size=1, max_size=30))
    def test_after_random_writes(self, db: Database, store: ObjectStore, ops: list[str]) -> None:
        w = world(db, store)  # the database keeps what earlier examples wrote: more history
        cache = SnapshotCache(CONFIG, full_every_s=1e9)
        compare(db, cache, w.epoch)
        for i, op in enumerate(ops):
            w.do(op)
            if i % 3 == 0 or i == len(ops) - 1:  # several writes between some passes
                compare(db, cache, w.epoch)
                assert not cache.stats.full, cache.stats

    def test_a_seeded_long_walk(self, db: Database, store: ObjectStore) -> None:
        w = world(db, store, seed=7)
        cache = SnapshotCache(CONFIG, full_every_s=1e9)
        compare(db, cache, w.epoch)
        for _ in range(150):
            w.do(w.rng.choice(World.OPS))
            compare(db, cache, w.epoch)
        assert not cache.stats.full

    def test_the_policy_decides_the_same_on_both(self, db: Database, store: ObjectStore) -> None:
        w = world(db, store, seed=3)
        cache = SnapshotCache(CONFIG, full_every_s=1e9)
        for _ in range(40):
            w.do(w.rng.choice(World.OPS))
        compare(db, cache, w.epoch)
        for _ in range(20):
            w.do(w.rng.choice(World.OPS))
        with db.snapshot() as s:
            now = db_now(s)
            inc = cache.load(s, now, epoch=w.epoch)
            full = load_snapshot(s, now)
        assert not cache.stats.full
        a, b = schedule(inc, CONFIG), schedule(full, CONFIG)
        assert a.decisions == b.decisions
        assert dict(a.waiting) == dict(b.waiting)


class TestFullRebuild:
    def test_first_pass_epoch_change_and_invalidate_read_everything(self, db: Database) -> None:
        create_team(db)
        create_node(db)
        epoch = become_leader(db)
        submit(db)
        cache = SnapshotCache(CONFIG, full_every_s=1e9)
        compare(db, cache, epoch)
        assert (cache.stats.full, cache.stats.reason) == (True, "first pass")
        # PostgreSQL's floor is the snapshot's xmin, which any open transaction on the server
        # holds back (another test worker's, a benchmark's): rows written since then may be
        # read again (safe, and bounded); SQLite's writers are serialized, so its floor is exact
        slack = 0 if db.is_sqlite else 1
        compare(db, cache, epoch)
        assert not cache.stats.full and cache.stats.jobs <= slack
        submit(db)
        compare(db, cache, epoch)
        assert not cache.stats.full and 1 <= cache.stats.jobs <= 1 + slack
        compare(db, cache, epoch + 1)
        assert (cache.stats.full, cache.stats.reason) == (True, "leader epoch changed")
        cache.invalidate()
        compare(db, cache, epoch + 1)
        assert (cache.stats.full, cache.stats.reason) == (True, "invalidated")

    def test_a_restarted_database_server_means_a_full_read(self, db: Database) -> None:
        create_team(db)
        cache = SnapshotCache(CONFIG, full_every_s=1e9)
        compare(db, cache)
        cache._server = "an earlier incarnation"  # as if PostgreSQL had restarted since
        compare(db, cache)
        assert (cache.stats.full, cache.stats.reason) == (True, "database server restarted")
        compare(db, cache)
        assert not cache.stats.full

    def test_periodic_full_read(self, db: Database) -> None:
        create_team(db)
        cache = SnapshotCache(CONFIG, full_every_s=0.0)
        compare(db, cache)
        compare(db, cache)
        assert (cache.stats.full, cache.stats.reason) == (True, "periodic")

    def test_a_deleted_node_leaves_the_snapshot(self, db: Database) -> None:
        create_team(db)
        create_node(db, "n1")
        create_node(db, "n2")
        cache = SnapshotCache(CONFIG, full_every_s=1e9)
        compare(db, cache)
        db.run_write(lambda s: allocate.remove_inventory(s, "n2"))
        db.run_write(lambda s: s.execute(text("DELETE FROM nodes WHERE id = 'n2'")))
        snap = compare(db, cache)
        assert [n.node_id for n in snap.nodes] == ["n1"]
        assert not cache.stats.full

    def test_missing_triggers_mean_a_full_read_every_pass(self, db: Database) -> None:
        create_team(db)
        cache = SnapshotCache(CONFIG, full_every_s=1e9)
        compare(db, cache)
        on = "" if db.is_sqlite else " ON jobs"
        # the PostgreSQL database is shared by the worker's later tests: put it back
        definition = (
            None
            if db.is_sqlite
            else db.run_write(
                lambda s: s.execute(
                    text(
                        "SELECT pg_get_triggerdef(oid) FROM pg_trigger"
                        " WHERE tgname = 'jobs_change_seq_upd'"
                    )
                ).scalar_one()
            )
        )
        db.run_write(lambda s: s.execute(text(f"DROP TRIGGER jobs_change_seq_upd{on}")))
        try:
            cache.invalidate()
            compare(db, cache)
            assert cache.stats.full and "no triggers" in cache.stats.reason
            submit(db)
            compare(db, cache)
            assert cache.stats.full
        finally:
            if definition is not None:
                db.run_write(lambda s: s.execute(text(definition)))


def test_the_migration_watches_the_columns_the_cache_reads() -> None:
    from importlib import import_module

    migration = import_module("gpufleet.store.migrations.versions.0012_day26_watch_job_resources")
    assert migration.WATCHED == WATCHED
