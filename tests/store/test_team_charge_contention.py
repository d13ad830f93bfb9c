"""The team row is every attempt's of that team: each ended attempt charges it
(``run_settle.charge_usage``). The charge used to lock the row FOR UPDATE in the middle of the
completion transaction and hold it to the commit: every other completion of the team queued
behind it, and so did every submit (a job's INSERT checks its team with FOR KEY SHARE, which
FOR UPDATE blocks). At 300 hollow nodes this serialized the whole controller
(benchmarks/fleet_scale.py: ~8 sessions waiting on the team row at any moment).

Replayed on PostgreSQL: transaction A charges the team and stays open; meanwhile another
completion's charge of the same team and a submit to it must both commit, and once A commits
the team holds both charges exactly (charges commute: ``policy.usage``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from gpufleet.domain.types import JobSpec, Resources
from gpufleet.policy.usage import UsageLedger
from gpufleet.services import auth
from gpufleet.services.job_submit import submit_job
from gpufleet.services.run_settle import charge_usage
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow, TeamRow
from tests.conftest import _empty

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(60)]

HALF_LIFE_S = 3600.0


@pytest.fixture
def pg(pg_url: str) -> Iterator[Database]:
    database = Database(pg_url)
    _empty(database)
    yield database
    database.dispose()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_an_open_charge_of_a_team_keeps_neither_its_other_ends_nor_its_submits_waiting(
    pg: Database,
) -> None:
    pg.run_write(lambda s: auth.create_team(s, "vision"))
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    a_end, b_end = t0 + timedelta(seconds=600), t0 + timedelta(seconds=900)

    def b_charge() -> None:
        pg.run_write(
            lambda s: charge_usage(
                s, "vision", 4, reserved_at=t0, released_at=b_end, half_life_s=HALF_LIFE_S
            )
        )

    def submit() -> str:
        spec = JobSpec(command=("true",), resources=Resources(gpu_count=1))
        return submit_job(pg, team_id="vision", idempotency_key="k1", spec=spec).job_id

    with pg.write_tx() as a:
        charge_usage(a, "vision", 8, reserved_at=t0, released_at=a_end, half_life_s=HALF_LIFE_S)
        a.flush()
        workers = [in_thread(b_charge), in_thread(submit)]
        for t, _ in workers:
            t.join(timeout=10)
        waiting = [t.is_alive() for t, _ in workers]
        # the assertion waits for A's commit (below): a blocked worker ends once A commits
    for t, out in workers:
        t.join(timeout=30)
        assert "error" not in out, out["error"]
    assert waiting == [False, False], "a charge or a submit waited on an open transaction"

    with pg.read() as s:
        team = s.execute(select(TeamRow).where(TeamRow.id == "vision")).scalar_one()
        jobs = s.scalars(select(JobRow.id).where(JobRow.team_id == "vision")).all()
    assert len(jobs) == 1
    expected = UsageLedger(0.0, 0.0, HALF_LIFE_S)
    expected.charge_attempt(4, t0.timestamp(), b_end.timestamp())
    expected.charge_attempt(8, t0.timestamp(), a_end.timestamp())
    assert team.usage_as_of is not None
    assert team.usage_as_of.timestamp() == pytest.approx(b_end.timestamp())
    assert team.usage_gpu_s == pytest.approx(expected.value, rel=1e-9)
