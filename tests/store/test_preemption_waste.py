"""The preemption waste cap through the live scheduler on both databases: a preemption whose
victim would lose more work than its team's cap (``teams.limits.preemption_waste``) or the
fleet's (``preemption_waste_gpu_h``) allows is not made and the preemptor's stored ``why``
says so; within the cap (or with it raised) the next pass makes it; what was lost is read
back per team from ``job_runs`` (``gpufleet usage`` and the cap's window)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from gpufleet.controller.leadership import Leadership
from gpufleet.controller.scheduler import Scheduler
from gpufleet.domain.errors import ValidationFailed
from gpufleet.objectstore import ObjectStore
from gpufleet.services.teams import QuotaUpdate, update_quota
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.preemption_waste import waste_per_team
from gpufleet.store.tables import JobRow, JobRunRow
from tests.factories import become_leader, create_node, create_team, submit
from tests.store.test_displacements import reserve_one
from tests.store.test_gangs import confirm
from tests.store.test_team_limits import _NoAgent


def _set(db: Database, limits: dict[str, object]) -> None:
    db.run_write(lambda s: update_quota(s, "team-a", QuotaUpdate(limits=limits)))


@pytest.fixture
def two_hours_of_low_work(db: Database) -> tuple[int, str]:
    """Team a runs a LOW job on all 8 GPUs of n1, started 2 h ago and never checkpointed
    (16 GPU-h lost if preempted now); (leader epoch, its run id)."""
    create_team(db)
    create_node(db, "n1", gpus=8)
    epoch = become_leader(db, "test-leader", lease_s=3600)
    low = submit(db, "team-a", gpus=8, priority="LOW").job_id
    r = reserve_one(db, low, "n1", 8, epoch)
    confirm(db, r)

    def backdate(s: Any) -> None:
        ago = db_now(s) - timedelta(hours=2)
        s.execute(
            update(JobRunRow)
            .where(JobRunRow.id == r.run_id)
            .values(started_at=ago, created_at=ago)
        )

    db.run_write(backdate)
    return epoch, r.run_id


def _scheduler(db: Database, tmp_path: Path, epoch: int, **settings: Any) -> Scheduler:
    return Scheduler(
        db,
        ObjectStore(str(tmp_path / "objects")),
        Settings(data_dir=tmp_path, **settings),
        Leadership("test-leader", epoch),
        _NoAgent(),  # type: ignore[arg-type]
    )


def _reason(db: Database, job_id: str) -> dict[str, Any]:
    with db.read() as s:
        row = s.get(JobRow, job_id)
        assert row is not None and row.status == "PENDING"
        return dict(row.pending_reason or {})


def test_a_preemption_over_the_teams_cap_is_not_made_until_the_cap_allows_it(
    db: Database, tmp_path: Path, two_hours_of_low_work: tuple[int, str]
) -> None:
    epoch, victim = two_hours_of_low_work
    _set(db, {"preemption_waste": {"gpu_hours": 10, "window_s": 86400}})
    crit = submit(db, "team-a", gpus=8, priority="CRITICAL").job_id
    sched = _scheduler(db, tmp_path, epoch)
    try:
        assert sched.run_pass().preempted == 0
        why = _reason(db, crit)
        assert why["code"] == "preemption_waste_cap", why
        assert "team team-a's preemption waste cap (10 GPU-h per 1 d" in why["message"]
        assert why["details"]["waste_cap"]["loss_gpu_h"] == pytest.approx(16.0, abs=0.1)
        with db.read() as s:
            assert s.get(JobRunRow, victim).stop_reason is None  # type: ignore[union-attr]
        _set(db, {"preemption_waste": {"gpu_hours": 20, "window_s": 86400}})
        assert sched.run_pass().preempted == 1
        with db.read() as s:
            run = s.get(JobRunRow, victim)
            assert run is not None and run.stop_reason == "preempt"
            lost = waste_per_team(s, None, None)
        assert lost == {"team-a": pytest.approx(16.0, abs=0.1)}
    finally:
        sched.close()


def test_the_fleet_cap_counts_earlier_losses_in_its_window(
    db: Database, tmp_path: Path, two_hours_of_low_work: tuple[int, str]
) -> None:
    epoch, _ = two_hours_of_low_work
    create_node(db, "n2", gpus=8)
    # an earlier preemption in the window lost 8 GPU-h (a run stopped for a preemption)
    old = submit(db, "team-a", gpus=8, priority="LOW").job_id
    r = reserve_one(db, old, "n2", 8, epoch)

    def preempted_earlier(s: Any) -> None:
        now = db_now(s)
        s.execute(
            update(JobRunRow)
            .where(JobRunRow.id == r.run_id)
            .values(
                created_at=now - timedelta(hours=3),
                started_at=now - timedelta(hours=3),
                stop_requested_at=now - timedelta(hours=2),
                stop_reason="preempt",
            )
        )

    db.run_write(preempted_earlier)
    with db.read() as s:
        assert waste_per_team(s, None, None) == {"team-a": pytest.approx(8.0, abs=0.1)}
    crit = submit(db, "team-a", gpus=16, priority="CRITICAL").job_id  # needs n1 too
    sched = _scheduler(db, tmp_path, epoch, preemption_waste_gpu_h=20.0)
    try:
        assert sched.run_pass().preempted == 0  # 8 + 16 > 20
        why = _reason(db, crit)
        assert why["code"] == "preemption_waste_cap", why
        assert why["details"]["waste_cap"]["scope"] == "fleet"
        assert why["details"]["waste_cap"]["used_gpu_h"] == pytest.approx(8.0, abs=0.1)
    finally:
        sched.close()


def test_bad_waste_limits_are_refused_naming_the_field(db: Database) -> None:
    create_team(db)
    with pytest.raises(ValidationFailed) as err:
        _set(db, {"preemption_waste": {"gpu_hours": -1}})
    assert err.value.field == "limits.preemption_waste.gpu_hours"
    with pytest.raises(ValidationFailed) as err:
        _set(db, {"preemption_waste": {"gpu_hours": 1, "window": 5}})
    assert err.value.field == "limits.preemption_waste.window"
