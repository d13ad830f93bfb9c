"""A time written by the database clock inside a statement (``dialect.now_sql``) compares with
the same instant read back and bound from Python: SQLite keeps datetimes as text compared as
text, so the two must have one format (a job once counted itself ahead of itself in its queue
position because its ``queued_at`` had 3 fractional digits and the bound value 6)."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select

from gpufleet.domain.types import JobSpec, Resources
from gpufleet.services.jobs import queue_position, submit_job
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow
from tests.factories import create_node, create_team


def test_clock_written_in_sql_equals_itself_bound_from_python(db: Database) -> None:
    create_team(db, "team-a")
    create_node(db, "n1", gpus=8)
    ids = [
        submit_job(
            db,
            team_id="team-a",
            idempotency_key=str(uuid.uuid4()),
            spec=JobSpec(command=("true",), resources=Resources(1)),
        ).job_id
        for _ in range(3)
    ]
    with db.read() as s:
        # the queue's order: the time each entered it, then id (SQLite's clock has millisecond
        # resolution, so back-to-back submits can share a queued_at)
        rows = [s.get(JobRow, job_id) for job_id in ids]
        ids = [r.id for r in sorted(rows, key=lambda r: (r.queued_at, r.id)) if r is not None]
        assert len(ids) == 3
        for i, job_id in enumerate(ids):
            job = s.get(JobRow, job_id)
            assert job is not None
            same = s.execute(
                select(func.count())
                .select_from(JobRow)
                .where(JobRow.id == job_id, JobRow.queued_at == job.queued_at)
            ).scalar_one()
            assert same == 1
            assert queue_position(s, job) == i + 1
