"""Confirm and completion on both databases: committed once, fenced by the token, retries
as new attempts with higher tokens, usage charged for the GPU-time really held."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import pytest

from gpufleet.domain.invariants import check_invariants
from gpufleet.domain.manifest import Manifest, ManifestFile
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.services import runs
from gpufleet.store.db import Database
from gpufleet.store.queries import load_invariant_view
from gpufleet.store.tables import JobRow, JobRunRow, NodeCapacityRow, ReservationRow, TeamRow
from tests.factories import become_leader, create_node, create_team, submit
from tests.store.test_allocate import reserve


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(str(tmp_path / "objects"))


def write_manifest(
    store: ObjectStore,
    job_id: str,
    run_id: str,
    token: int,
    exit_code: int = 0,
    tamper: bool = False,
    more: tuple[str, ...] = (),
) -> str:
    """The attempt's manifest: artifact ``model.bin`` (b"weights") and one artifact per path
    of ``more`` (its bytes: the path in UTF-8)."""
    prefix = attempt_prefix(job_id, run_id)
    data = b"weights"
    key = f"{prefix}/artifacts/model.bin"
    store.put_bytes(key, data)
    digest = hashlib.sha256(data + (b"x" if tamper else b"")).hexdigest()
    extra = []
    for path in more:
        body = path.encode()
        k = f"{prefix}/artifacts/{path}"
        store.put_bytes(k, body)
        sha = hashlib.sha256(body).hexdigest()
        extra.append(ManifestFile("artifact", path, k, store.uri(k), sha, len(body)))
    m = Manifest(
        job_id=job_id,
        run_id=run_id,
        token=token,
        outcome="EXITED",
        exit_code=exit_code,
        started_at_s=time.time(),
        finished_at_s=time.time(),
        files=(
            ManifestFile("artifact", "model.bin", key, store.uri(key), digest, len(data)),
            *extra,
        ),
    )
    return store.put_bytes(f"{prefix}/MANIFEST.json", m.to_json())


def report(store: ObjectStore, job_id: str, r, exit_code: int = 0, **kw) -> runs.Report:
    uri = write_manifest(store, job_id, r.run_id, r.token, exit_code, **kw)
    return runs.Report(
        node_id="n1",
        run_id=r.run_id,
        token=r.token,
        outcome=runs.Outcome.EXITED,
        exit_code=exit_code,
        manifest_uri=uri,
    )


def setup(db: Database, gpus: int = 2, max_retries: int = 0):
    create_team(db)
    create_node(db, "n1", gpus=8)
    epoch = become_leader(db)
    job = submit(db, gpus=gpus, max_retries=max_retries)
    return job.job_id, epoch


def state(db: Database, job_id: str):
    with db.read() as s:
        job = s.get(JobRow, job_id)
        runs_ = s.query(JobRunRow).filter_by(job_id=job_id).order_by(JobRunRow.attempt).all()
        free = s.get(NodeCapacityRow, "n1").available_gpus
        assert check_invariants(load_invariant_view(s)) == []
        return job, runs_, free


class TestCompletion:
    def test_success_commits_once_and_releases(self, db: Database, store: ObjectStore) -> None:
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        assert (
            db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
            == runs.Confirm.CONFIRMED
        )
        rep = report(store, job_id, r)
        assert runs.complete_run(db, store, rep)[0] == runs.CompletionResult.ACCEPTED
        job, (run,), free = state(db, job_id)
        assert (job.status, run.status, free) == ("SUCCEEDED", "SUCCEEDED", 8)
        assert job.result_uri == rep.manifest_uri
        # a repeated report (lost ack) is answered ACCEPTED and changes nothing
        assert runs.complete_run(db, store, rep)[0] == runs.CompletionResult.ACCEPTED
        assert state(db, job_id)[2] == 8

    def test_a_killing_signal_is_named(self, db: Database, store: ObjectStore) -> None:
        """A job killed by SIGKILL (exit code -9 as the agent reports it) failed with
        "exited with code -9"; it names the signal."""
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        runs.complete_run(db, store, report(store, job_id, r, exit_code=-9))
        job, (run,), _ = state(db, job_id)
        assert (job.status, run.exit_code) == ("FAILED", -9)
        assert job.failure_reason == "killed by signal 9 (SIGKILL)"

    def test_the_agents_note_on_an_exit_reaches_the_failure_reason(
        self, db: Database, store: ObjectStore
    ) -> None:
        """A container whose conmon died ends with its exit status lost: the job's reason
        says so, not only "killed by signal 9" (the note used to stay in the agent's log)."""
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        rep = report(store, job_id, r, exit_code=-9)
        note = "exit status lost (conmon died); processes verified gone"
        runs.complete_run(db, store, dataclasses.replace(rep, message=note))
        job, _, _ = state(db, job_id)
        assert job.failure_reason == (
            "killed by signal 9 (SIGKILL): exit status lost (conmon died); processes verified gone"
        )

    def test_failure_with_a_retry_gets_a_new_attempt_and_a_higher_token(self, db, store) -> None:
        job_id, epoch = setup(db, max_retries=1)
        first = reserve(db, job_id, "n1", 2, epoch=epoch)
        runs.complete_run(db, store, report(store, job_id, first, exit_code=3))
        job, _, free = state(db, job_id)
        assert (job.status, free) == ("PENDING", 8)
        second = reserve(db, job_id, "n1", 2, epoch=epoch, seen=job.fencing_epoch)
        assert second.run_id != first.run_id and second.token > first.token and second.attempt == 2
        runs.complete_run(db, store, report(store, job_id, second, exit_code=3))
        job, attempts, free = state(db, job_id)
        assert (
            job.status == "FAILED" and "exit" in job.failure_reason and "3" in job.failure_reason
        )
        assert [(a.status, a.exit_code) for a in attempts] == [("FAILED", 3), ("FAILED", 3)]

    def test_stale_attempt_cannot_publish(self, db, store) -> None:
        job_id, epoch = setup(db, max_retries=1)
        first = reserve(db, job_id, "n1", 2, epoch=epoch)
        old = report(store, job_id, first, exit_code=0)
        # pretend the first attempt was written off: forged newer token on the report
        forged = dataclasses.replace(old, token=first.token + 5)
        assert runs.complete_run(db, store, forged)[0] == runs.CompletionResult.STALE
        job, (run,), free = state(db, job_id)
        assert (job.status, run.status, free) == ("SCHEDULED", "ASSIGNED", 6)

    def test_tampered_manifest_is_rejected(self, db, store) -> None:
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        result, why = runs.complete_run(db, store, report(store, job_id, r, tamper=True))
        assert result == runs.CompletionResult.REJECTED and "sha256" in why
        job, (run,), free = state(db, job_id)
        assert (job.status, run.status, free) == ("FAILED", "FAILED", 8)

    def test_stale_confirm_is_rejected(self, db, store) -> None:
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        assert (
            db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token + 1))
            == runs.Confirm.REJECTED
        )
        with db.read() as s:
            assert s.query(ReservationRow).filter_by(run_id=r.run_id).one().status == "RESERVED"

    def test_a_first_confirm_moves_each_row_once_and_a_repeat_only_updates(
        self, db, store
    ) -> None:
        """The first confirmation (one guarded UPDATE of the run, RETURNING) and a repeated one
        (the read decides): one event per transition, the repeat's pid kept, the rows moved
        once."""
        from sqlalchemy import select

        from gpufleet.store.tables import SchedulingEventRow

        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        phases = {"runtime": "process", "start_s": 0.25}

        def confirm(pid: int, **kw) -> runs.Confirmed:
            return db.run_write(
                lambda s: runs.confirm_start(s, r.run_id, r.token, pid, node_id="n1", **kw)
            )

        first = confirm(41, start_phases=phases)
        assert first.result == runs.Confirm.CONFIRMED
        assert first.start_phases == phases and first.gpu_count == 2
        assert first.spec is not None and first.queued_at is not None
        again = confirm(42, start_phases={"runtime": "other"})
        assert again.result == runs.Confirm.CONFIRMED and again.start_phases == phases
        with db.read() as s:
            run = s.get(JobRunRow, r.run_id)
            assert (run.status, run.pid, run.start_phases) == ("RUNNING", 42, phases)
            assert run.started_at == first.started_at == run.assigned_at
            assert s.get(JobRow, job_id).status == "RUNNING"
            assert s.query(ReservationRow).filter_by(run_id=r.run_id).one().status == "CONFIRMED"
            moves = s.execute(
                select(
                    SchedulingEventRow.kind,
                    SchedulingEventRow.machine,
                    SchedulingEventRow.to_status,
                ).where(
                    SchedulingEventRow.job_id == job_id, SchedulingEventRow.at >= run.started_at
                )
            ).all()
        assert sorted(moves, key=str) == sorted(
            [
                ("start_phases", None, None),
                ("transition", "run", "RUNNING"),
                ("transition", "reservation", "CONFIRMED"),
                ("transition", "job", "RUNNING"),
            ],
            key=str,
        )

    def test_a_confirm_of_an_attempt_no_longer_current_changes_nothing(self, db, store) -> None:
        from sqlalchemy import update

        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        # the job moved on (its fencing epoch is no longer this attempt's token)
        db.run_write(
            lambda s: s.execute(update(JobRow).where(JobRow.id == job_id).values(fencing_epoch=9))
        )
        assert (
            db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token, 7))
            == runs.Confirm.REJECTED
        )
        with db.read() as s:
            run = s.get(JobRunRow, r.run_id)
            assert (run.status, run.pid, run.started_at) == ("ASSIGNED", None, None)
            assert s.query(ReservationRow).filter_by(run_id=r.run_id).one().status == "RESERVED"

    def test_a_confirm_records_the_delivery_it_implies(self, db, store) -> None:
        """The controller skips its own delivery write for a fresh STARTED answer: the
        confirmation sets ``assigned_at`` with ``started_at``; an earlier delivery is kept."""
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
        with db.read() as s:
            run = s.get(JobRunRow, r.run_id)
            assert run.status == "RUNNING" and run.assigned_at == run.started_at is not None
        job2 = submit(db, gpus=2)
        r2 = reserve(db, job2.job_id, "n1", 2, epoch=epoch)
        db.run_write(lambda s: runs.mark_delivered(s, r2.run_id))
        time.sleep(0.05)
        db.run_write(lambda s: runs.confirm_assignment(s, r2.run_id, r2.token))
        with db.read() as s:
            run2 = s.get(JobRunRow, r2.run_id)
            assert run2.assigned_at is not None and run2.assigned_at < run2.started_at

    def test_retries_charge_only_the_gpu_time_really_held(self, db, store) -> None:
        job_id, epoch = setup(db, gpus=2, max_retries=1)
        first = reserve(db, job_id, "n1", 2, epoch=epoch)
        db.run_write(lambda s: runs.confirm_assignment(s, first.run_id, first.token))
        time.sleep(0.2)
        runs.complete_run(db, store, report(store, job_id, first, exit_code=1))
        with db.read() as s:
            run = s.get(JobRunRow, first.run_id)
            held = 2 * (run.finished_at - run.created_at).total_seconds()  # reserve -> release
            usage = s.get(TeamRow, "team-a").usage_gpu_s
        # to the microsecond (times are stored in microseconds; charges are computed from
        # epoch floats, whose rounding is ~0.2 us)
        assert usage == pytest.approx(held, abs=2 * 2e-6) and usage >= 0.4
        # the repeated report charges nothing more
        runs.complete_run(db, store, report(store, job_id, first, exit_code=1))
        with db.read() as s:
            assert s.get(TeamRow, "team-a").usage_gpu_s == pytest.approx(usage)

    def test_a_late_report_ends_the_attempt_and_its_usage_at_the_exit(self, db, store) -> None:
        """Issue 24, item 12: the report arrives 30 s after the exit (by the agent's own
        clock): the run and its usage record end then, clamped to the attempt's start."""
        from sqlalchemy import select

        from gpufleet.store.tables import UsageRecordRow

        job_id, epoch = setup(db, gpus=2)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
        time.sleep(0.3)
        late = dataclasses.replace(report(store, job_id, r), ended_ago_s=0.2)
        assert runs.complete_run(db, store, late)[0] == runs.CompletionResult.ACCEPTED
        with db.read() as s:
            job, run = s.get(JobRow, job_id), s.get(JobRunRow, r.run_id)
            rec = s.scalars(select(UsageRecordRow)).one()
        assert rec.end_at == run.finished_at
        assert (job.finished_at - run.finished_at).total_seconds() == pytest.approx(0.2, abs=1e-3)
        assert rec.gpu_seconds == pytest.approx(
            2 * (run.finished_at - run.created_at).total_seconds()
        )

    @pytest.mark.parametrize(
        ("ago_s", "want_s"),
        [
            pytest.param(None, 100.0, id="unknown: the receipt"),
            pytest.param(-5.0, 100.0, id="the agent's clock stepped back: the receipt"),
            pytest.param(30.0, 70.0, id="30 s before the receipt"),
            pytest.param(500.0, 10.0, id="never before the attempt's start"),
        ],
    )
    def test_ended_at_is_clamped(self, ago_s: float | None, want_s: float) -> None:
        from datetime import UTC, datetime, timedelta

        t0 = datetime(2026, 1, 1, tzinfo=UTC)
        got = runs.ended_at(
            t0 + timedelta(seconds=100), ago_s, started_at=t0 + timedelta(seconds=10)
        )
        assert got == t0 + timedelta(seconds=want_s)


class TestRequeue:
    def test_a_preempted_job_keeps_its_place_a_failed_one_goes_back(self, db, store) -> None:
        job_id, epoch = setup(db, max_retries=1)
        with db.read() as s:
            queued = s.get(JobRow, job_id).queued_at
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        db.run_write(lambda s: runs.request_stop(s, r.run_id, r.token, "preempt", message="t"))
        stopped = dataclasses.replace(
            report(store, job_id, r, exit_code=143), outcome=runs.Outcome.STOPPED
        )
        assert runs.complete_run(db, store, stopped)[0] == runs.CompletionResult.ACCEPTED
        job, (run,), _ = state(db, job_id)
        assert (job.status, run.status, job.queued_at) == ("PENDING", "PREEMPTED", queued)
        again = reserve(db, job_id, "n1", 2, epoch=epoch, seen=job.fencing_epoch)
        runs.complete_run(db, store, report(store, job_id, again, exit_code=1))
        job, _, _ = state(db, job_id)
        assert job.status == "PENDING" and job.queued_at > queued


class TestManifestKeys:
    """A forged manifest cannot vouch for objects outside its attempt's prefix."""

    def forged(self, store, job_id, r, key: str, path: str = "model.bin") -> runs.Report:
        m = Manifest(
            job_id=job_id,
            run_id=r.run_id,
            token=r.token,
            outcome="EXITED",
            exit_code=0,
            started_at_s=time.time(),
            finished_at_s=time.time(),
            files=(ManifestFile("artifact", path, key, "u", hashlib.sha256(b"v").hexdigest(), 1),),
        )
        uri = store.put_bytes(f"{attempt_prefix(job_id, r.run_id)}/MANIFEST.json", m.to_json())
        return runs.Report("n1", r.run_id, r.token, runs.Outcome.EXITED, 0, uri)

    @pytest.mark.parametrize(
        "how",
        [
            pytest.param("dotdot", id="key with .. into another job's attempt"),
            pytest.param("path", id="path with .."),
            pytest.param("absolute", id="absolute key"),
        ],
    )
    def test_keys_outside_the_prefix_are_rejected(self, db, store, how) -> None:
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        # another job's real artifact, whose size and sha256 the forger knows
        victim = "jobs/j-victim/attempts/r-victim/artifacts/model.bin"
        store.put_bytes(victim, b"v")
        prefix = attempt_prefix(job_id, r.run_id)
        key, path = {
            "dotdot": (f"{prefix}/artifacts/../../../../{victim}", "model.bin"),
            "path": (f"{prefix}/artifacts/../../../../{victim}", f"../../../../{victim}"),
            "absolute": ("/" + victim, "model.bin"),
        }[how]
        result, why = runs.complete_run(db, store, self.forged(store, job_id, r, key, path))
        assert result == runs.CompletionResult.REJECTED, why
        job, (run,), free = state(db, job_id)
        assert (job.status, run.status, free) == ("FAILED", "FAILED", 8)

    def test_a_manifest_of_another_job_is_rejected(self, db, store) -> None:
        job_id, epoch = setup(db)
        r = reserve(db, job_id, "n1", 2, epoch=epoch)
        rep = report(store, job_id, r)
        m = Manifest.from_json(store.get_bytes(store.key_of(rep.manifest_uri)))
        other = dataclasses.replace(m, job_id="j-someone-else")
        store.put_bytes(store.key_of(rep.manifest_uri), other.to_json())
        result, why = runs.complete_run(db, store, rep)
        assert result == runs.CompletionResult.REJECTED and "job_id" in why


class TestNodeFaults:
    """Found by tests/chaos (seed 22, 60 s): a full disk made an agent refuse 3 assignments
    placed before the controller saw it UNHEALTHY; they auto-cordoned the node, which stayed
    CORDONED after the disk was freed."""

    def _never_started(
        self, db: Database, store: ObjectStore, message: str, refused: bool = False
    ) -> None:
        job = submit(db, gpus=1)
        r = reserve(db, job.job_id, "n1", 1, epoch=self.epoch)
        rep = runs.Report(
            node_id="n1",
            run_id=r.run_id,
            token=r.token,
            outcome=runs.Outcome.NEVER_STARTED,
            exit_code=0,
            manifest_uri="",
            message=message,
            node_fault=True,
            node_refused=refused,
        )
        assert runs.complete_run(db, store, rep, inferred=True)[0] == (
            runs.CompletionResult.ACCEPTED
        )

    def _node_status(self, db: Database) -> str:
        from gpufleet.store.tables import NodeRow

        with db.read() as s:
            return str(s.get(NodeRow, "n1").status)

    def test_health_refusals_do_not_cordon_but_start_failures_do(
        self, db: Database, store: ObjectStore
    ) -> None:
        create_team(db)
        create_node(db, "n1", gpus=8)
        self.epoch = become_leader(db)
        for message in (
            "node unhealthy: disk: /state has 0 MiB free, below the reserve of 2 MiB",
            "refused earlier: node unhealthy",
            "node unhealthy: disk: /state has 1 MiB free, below the reserve of 2 MiB",
        ):
            self._never_started(db, store, message, refused=True)
        assert self._node_status(db) == "HEALTHY"
        for _ in range(3):
            self._never_started(db, store, "ENOSPC: no space left on device")
        assert self._node_status(db) == "CORDONED"

    def test_a_retry_carries_the_node_its_attempt_failed_to_start_on(
        self, db: Database, store: ObjectStore
    ) -> None:
        """The pending retry of a job whose attempt never started on n1 carries n1 as the node
        to avoid, in the plain snapshot and in the leader's incremental cache alike, and the
        pass places it on n2 though n1 is the better fit; a job that has not failed to start
        carries none."""
        from gpufleet.policy.cycle import schedule
        from gpufleet.policy.decisions import Place
        from gpufleet.store.dialect import db_now
        from gpufleet.store.queries import load_snapshot
        from gpufleet.store.snapshot_cache import SnapshotCache

        create_team(db)
        create_node(db, "n1", gpus=2)
        create_node(db, "n2", gpus=8)
        self.epoch = become_leader(db)
        other = submit(db, gpus=1)
        cache = SnapshotCache(full_every_s=1e9)
        with db.snapshot() as s:
            cache.load(s, db_now(s), epoch=1)  # a full read before the failure
        self._never_started(db, store, "cannot create the container: podman died")
        with db.snapshot() as s:
            now = db_now(s)
            plain = {j.job_id: j for j in load_snapshot(s, now).pending}
            snap = cache.load(s, now, epoch=1)
        assert not cache.stats.full
        cached = {j.job_id: j for q in (snap.queues or {}).values() for j in q}
        failed = next(j for j in plain if j != other.job_id)
        assert plain[failed].avoid_node_id == "n1" == cached[failed].avoid_node_id
        assert plain[other.job_id].avoid_node_id is None is cached[other.job_id].avoid_node_id
        places = {d.job_id: d.node_id for d in schedule(snap).decisions if isinstance(d, Place)}
        assert places[failed] == "n2"

    def test_uncordon_starts_the_failure_count_again(
        self, db: Database, store: ObjectStore
    ) -> None:
        """Three node-caused start failures cordon the node; after an operator's uncordon one
        more failure must not cordon it again (the count restarts), three more do."""
        from gpufleet.domain.states import NodeStatus
        from gpufleet.services import nodes

        create_team(db)
        create_node(db, "n1", gpus=8)
        self.epoch = become_leader(db)
        for _ in range(3):
            self._never_started(db, store, "podman pull failed: no space left on device")
        assert self._node_status(db) == "CORDONED"
        db.run_write(
            lambda s: nodes.set_node_status(s, "n1", NodeStatus.HEALTHY, message="uncordon")
        )
        self._never_started(db, store, "podman pull failed: no space left on device")
        assert self._node_status(db) == "HEALTHY"
        self._never_started(db, store, "podman pull failed: no space left on device")
        assert self._node_status(db) == "HEALTHY"
        self._never_started(db, store, "podman pull failed: no space left on device")
        assert self._node_status(db) == "CORDONED"


def test_a_cancel_records_its_outcome_sentence_once(db: Database, store: ObjectStore) -> None:
    """The stopped attempt's event says "cancelled by user; processes verified gone"; the
    job's own event says "cancelled by user" (it used to repeat the attempt's sentence)."""
    from sqlalchemy import select, update

    from gpufleet.store.tables import SchedulingEventRow as EventRow

    job_id, epoch = setup(db)
    r = reserve(db, job_id, "n1", 2, epoch=epoch)
    db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))

    def stopping(s) -> None:  # what the controller's cancel path does before the stop
        s.execute(update(JobRow).where(JobRow.id == job_id).values(cancel_requested=True))
        s.execute(
            update(JobRunRow)
            .where(JobRunRow.id == r.run_id)
            .values(status="PREEMPTING", stop_reason="cancel")
        )

    db.run_write(stopping)
    rep = dataclasses.replace(
        report(store, job_id, r, exit_code=-15), outcome=runs.Outcome.STOPPED
    )
    assert runs.complete_run(db, store, rep)[0] == runs.CompletionResult.ACCEPTED
    job, (run,), free = state(db, job_id)
    assert (job.status, run.status, free) == ("CANCELLED", "CANCELLED", 8)
    with db.read() as s:
        said = [e.message for e in s.scalars(select(EventRow).where(EventRow.job_id == job_id))]
    assert said.count("cancelled by user; processes verified gone") == 1, said
    assert "cancelled by user" in said
