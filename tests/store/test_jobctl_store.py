"""Job control in the store, on SQLite and PostgreSQL: references, array submit and replay,
gates read from rows, hold/release/requeue/PATCH guards."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from gpufleet.domain.errors import Conflict, IdempotencyKeyReused, NotFound, ValidationFailed
from gpufleet.domain.types import JobSpec, Resources
from gpufleet.services import jobctl, jobs
from gpufleet.services.jobs import SubmitControl, submit_job
from gpufleet.store import gating
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow
from tests.factories import create_team


def sub(db: Database, name: str = "", team: str = "team-a", key: str | None = None,
        **control: object) -> object:  # fmt: skip
    return submit_job(
        db,
        team_id=team,
        idempotency_key=key or str(uuid.uuid4()),
        spec=JobSpec(command=("true",), resources=Resources(1), name=name),
        control=SubmitControl(**control),  # type: ignore[arg-type]
    )


def test_references_prefixes_names_and_ambiguity(db: Database) -> None:
    create_team(db)
    create_team(db, "team-b")
    a = sub(db, "train").job_id  # type: ignore[attr-defined]
    b = sub(db, "train").job_id  # type: ignore[attr-defined]
    other = sub(db, "mine", team="team-b").job_id  # type: ignore[attr-defined]
    with db.read() as s:
        assert jobctl.resolve_job_ref(s, "team-a", a) == a
        assert jobctl.resolve_job_ref(s, "team-a", b[:-2]) == b
        assert jobctl.resolve_job_ref(s, "team-a", b[2:-2].upper()) == b  # no j-, any case
        assert jobctl.resolve_job_ref(s, "team-a", "train") == b  # the newest of that name
        with pytest.raises(ValidationFailed) as err:
            jobctl.resolve_job_ref(s, "team-a", a[:6])
        assert err.value.code == "ambiguous_job_ref" and a in err.value.message
        for ref in (other, other[:-1], "mine", "j-zz", "nothing"):
            with pytest.raises(NotFound):
                jobctl.resolve_job_ref(s, "team-a", ref)
        assert jobctl.resolve_job_ref(s, None, "mine") == other  # admin: every team


def test_a_too_short_prefix_says_so(db: Database) -> None:
    create_team(db)
    a = sub(db, "train").job_id  # type: ignore[attr-defined]
    with db.read() as s:
        for ref in (a[:4], a[2:5], "j-01"):  # j- and 2..3 characters: below the minimum
            with pytest.raises(NotFound) as err:
                jobctl.resolve_job_ref(s, "team-a", ref)
            msg = err.value.message
            assert "too short" in msg and f"at least {jobctl.MIN_PREFIX}" in msg, msg
            assert "no id starts with it" not in msg
        with pytest.raises(NotFound) as err:
            jobctl.resolve_job_ref(s, "team-a", "nothing")
        assert "too short" not in err.value.message


def test_array_submit_gates_and_replay(db: Database) -> None:
    create_team(db)
    key = str(uuid.uuid4())
    out = sub(db, "sweep", key=key, array="0-5%2")
    again = sub(db, "sweep", key=key, array="0-5%2")
    assert again.created is False and again.job_ids == out.job_ids  # type: ignore[attr-defined]
    with pytest.raises(Conflict):  # same key, another array: another payload
        sub(db, "sweep", key=key, array="0-6%2")
    first = out.job_ids[0]  # type: ignore[attr-defined]
    dep = sub(db, depends_on=f"afterok:{out.array_id}")  # type: ignore[attr-defined]
    with db.read() as s:
        row = s.get(JobRow, out.job_ids[3])  # type: ignore[attr-defined]
        assert row is not None and row.spec["env"]["GPUFLEET_ARRAY_INDEX"] == "3"
        assert row.array_max_running == 2 and row.gated
        gates = gating.load_gates(s)
        result = gating.evaluate(s, gates)
    assert len(gates) == 7
    assert result.blocked[dep.job_id].code == "dependency"  # type: ignore[attr-defined]
    throttled = {j for j, r in result.blocked.items() if r.code == "array_throttled"}
    assert throttled == set(out.job_ids[2:])  # type: ignore[attr-defined]
    # a FAILED dependency: the dependent can never run
    db.run_write(lambda s: s.execute(
        JobRow.__table__.update().where(JobRow.id == first).values(status="FAILED")))  # fmt: skip
    with db.read() as s:
        result = gating.evaluate(s, gating.load_gates(s))
    assert dep.job_id in result.failed  # type: ignore[attr-defined]
    with db.read() as s:
        now = s.get(JobRow, first).created_at  # type: ignore[union-attr]
    ended = db.run_write(lambda s: gating.fail_dependents(s, result.failed, now))
    assert ended == [dep.job_id]  # type: ignore[attr-defined]
    with db.read() as s:
        assert s.get(JobRow, dep.job_id).status == "DEPENDENCY_FAILED"  # type: ignore[attr-defined,union-attr]


def test_hold_release_requeue_patch_guards(db: Database) -> None:
    create_team(db)
    job = sub(db, "h").job_id  # type: ignore[attr-defined]
    db.run_write(lambda s: jobctl.hold_job(s, "team-a", job))
    db.run_write(lambda s: jobctl.hold_job(s, "team-a", job))  # idempotent
    with db.read() as s:
        assert [g.job_id for g in gating.load_gates(s) if g.held] == [job]
    with pytest.raises(Conflict):
        db.run_write(lambda s: jobctl.requeue_job(s, "team-a", job))  # PENDING
    db.run_write(lambda s: jobctl.release_job(s, "team-a", job))
    with db.read() as s:
        assert gating.load_gates(s) == []
    db.run_write(lambda s: jobctl.patch_job(s, "team-a", job, jobctl.JobPatch("HIGH", "h2", 30.0)))
    with db.read() as s:
        row = s.get(JobRow, job)
        assert row is not None
        assert (row.priority, row.priority_rank, row.name, row.max_runtime_s) == (
            "HIGH", 2, "h2", 30.0)  # fmt: skip
        assert row.spec["max_runtime_s"] == 30.0
    with pytest.raises(NotFound):
        db.run_write(lambda s: jobctl.hold_job(s, "team-b", job))
    db.run_write(lambda s: jobctl.release_job(s, "team-a", job))  # not held: nothing to do
    assert jobs.cancel_job_outcome(db, "team-a", job) == ("CANCELLED", False)
    assert jobs.cancel_job_outcome(db, "team-a", job) == ("CANCELLED", True)  # already
    with pytest.raises(Conflict) as err:  # finished: like hold, not a silent "released"
        db.run_write(lambda s: jobctl.release_job(s, "team-a", job))
    assert err.value.code == "job_not_pending"
    assert "only a held PENDING job can be released" in err.value.message
    n = len(db.run_write(lambda s: list(s.scalars(select(JobRow.id)))))
    assert n == 1


def test_array_with_the_longest_idempotency_key(db: Database) -> None:
    create_team(db)
    key = "k" * 256  # the API's limit; task keys must still fit the column
    out = sub(db, key=key, array="0-999:100")
    assert len(out.job_ids) == 10  # type: ignore[attr-defined]
    assert sub(db, key=key, array="0-999:100").job_ids == out.job_ids  # type: ignore[attr-defined]


def test_an_array_whose_task_key_is_another_jobs_key_is_a_conflict_naming_the_header(
    db: Database,
) -> None:
    """Task i of an array is stored under ``key#i``; when an earlier job already has that key
    the submission is a 409 naming Idempotency-Key (it was a 500), and nothing is written."""
    create_team(db)
    other = sub(db, key="k1#2")
    with pytest.raises(IdempotencyKeyReused) as err:
        sub(db, key="k1", array="0-3")
    assert err.value.field == "Idempotency-Key" and other.job_id in str(err.value)
    with db.read() as s:
        keys = s.scalars(select(JobRow.idempotency_key)).all()
    assert keys == ["k1#2"]


def test_afternotok_on_a_cancelled_job_counts_only_if_it_ran(db: Database) -> None:
    """Issue 24 item 10: a CANCELLED dependency satisfies ``afternotok`` only if its code
    started (``started_at``); a requeue of the finished job clears that, so its new outcome
    decides."""
    create_team(db)
    ran = sub(db, "ran").job_id  # type: ignore[attr-defined]
    never = sub(db, "never").job_id  # type: ignore[attr-defined]
    on_ran = sub(db, depends_on=f"afternotok:{ran}").job_id  # type: ignore[attr-defined]
    on_never = sub(db, depends_on=f"afternotok:{never}").job_id  # type: ignore[attr-defined]
    table = JobRow.__table__
    with db.read() as s:
        at = s.get(JobRow, ran).created_at  # type: ignore[union-attr]
    db.run_write(lambda s: s.execute(table.update().where(JobRow.id == ran).values(
        status="CANCELLED", started_at=at)))  # fmt: skip
    db.run_write(lambda s: s.execute(table.update().where(JobRow.id == never).values(
        status="CANCELLED")))  # fmt: skip
    with db.read() as s:
        result = gating.evaluate(s, gating.load_gates(s))
    assert on_ran not in result.failed and on_ran not in result.blocked  # released
    assert "before it ever ran" in result.failed[on_never]
    # requeued, the job that ran is unfinished again and has not run in its new life
    db.run_write(lambda s: jobctl.requeue_job(s, "team-a", ran))
    with db.read() as s:
        row = s.get(JobRow, ran)
        assert row is not None and row.status == "PENDING" and row.started_at is None
