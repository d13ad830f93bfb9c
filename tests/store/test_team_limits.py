"""Team limits in the store (both databases): validation, the ledger's use per window, and
the submit-time class rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpufleet.domain.errors import ValidationFailed
from gpufleet.services.job_admission import read_class_rules
from gpufleet.services.teams import QuotaUpdate, update_quota
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow, UsageRecordRow
from gpufleet.store.team_limits import ledger_use
from tests.factories import create_node, create_team, submit

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def _set(db: Database, team: str, limits: dict[str, object]) -> None:
    db.run_write(lambda s: update_quota(s, team, QuotaUpdate(limits=limits)))


def _record(db: Database, run: str, prio: str, start: datetime, end: datetime, gpus: int) -> None:
    def tx(s):  # type: ignore[no-untyped-def]
        s.add(
            UsageRecordRow(
                run_id=run,
                job_id="j-" + run,
                attempt=1,
                team_id="team-a",
                token_id=None,
                user="",
                node_id="n1",
                gpu_type="H100",
                gpus=gpus,
                start_at=start,
                end_at=end,
                gpu_seconds=(end - start).total_seconds() * gpus,
                outcome="SUCCEEDED",
                priority=prio,
            )
        )

    db.run_write(tx)


def test_ledger_use_clips_to_the_window_and_counts_by_class(db: Database) -> None:
    create_team(db)
    _set(db, "team-a", {"class_budgets": {"CRITICAL": {"gpu_hours": 10, "window_s": 86400}}})
    day = timedelta(days=1)
    h = timedelta(hours=1)
    _record(db, "r1", "CRITICAL", NOW - 2 * day, NOW - day - h, 8)  # ended before: no
    _record(db, "r2", "CRITICAL", NOW - day - 2 * h, NOW - day + h, 2)  # 1 h inside: 2 GPU-h
    _record(db, "r3", "CRITICAL", NOW - 3 * h, NOW - h, 4)  # 8 GPU-h
    _record(db, "r4", "NORMAL", NOW - 3 * h, NOW - h, 4)  # another class
    with db.read() as s:
        limits = {"team-a": read_class_rules(s, "team-a")}
        use = ledger_use(s, limits, NOW.timestamp())
    got = use[("team-a", "class:CRITICAL")]
    assert got.used_gpu_s == pytest.approx(10 * 3600)
    assert [round(g / 3600, 3) for _, g in got.releases] == [2.0, 8.0]  # by end, clipped


def test_bad_limits_are_refused_naming_the_field(db: Database) -> None:
    create_team(db)
    bad = {"class_budgets": {"CRITICAL": {"gpu_hours": -1}}}
    with pytest.raises(ValidationFailed) as err:
        _set(db, "team-a", bad)
    assert err.value.field == "limits.class_budgets.CRITICAL.gpu_hours"
    with pytest.raises(ValidationFailed) as err:
        _set(db, "team-a", {"allowed_classes": ["URGENT"]})
    assert err.value.field == "limits.allowed_classes[0]"
    with pytest.raises(ValidationFailed) as err:
        _set(db, "team-a", {"gpu_budgets": [{"gpu_hours": 5, "period": "rolling"}]})
    assert err.value.field == "limits.gpu_budgets[0].window_s"


def test_a_budget_of_a_gpu_type_no_node_has_is_refused(db: Database) -> None:
    """As guarantees are: the field and the fleet's types named; a known type is taken."""
    create_team(db)
    create_node(db)  # H100
    with pytest.raises(ValidationFailed) as err:
        _set(db, "team-a", {"gpu_budgets": [{"gpu_hours": 10, "gpu_type": "NOPE"}]})
    assert err.value.field == "limits.gpu_budgets[0].gpu_type"
    assert "'NOPE'" in str(err.value) and "H100" in str(err.value)
    _set(db, "team-a", {"gpu_budgets": [{"gpu_hours": 10, "gpu_type": "H100"}]})


def test_two_rolling_windows_are_two_budgets(db: Database) -> None:
    create_team(db)
    two = [
        {"gpu_hours": 1, "period": "rolling", "window_s": 7200},
        {"gpu_hours": 2, "period": "rolling", "window_s": 2592000, "hard": True},
    ]
    _set(db, "team-a", {"gpu_budgets": two})
    with db.read() as s:
        lim = read_class_rules(s, "team-a")
    assert sorted(b.key for b in lim.gpu_budgets) == ["gpu:*:rolling:2h", "gpu:*:rolling:30d"]
    with pytest.raises(ValidationFailed) as err:
        _set(db, "team-a", {"gpu_budgets": [*two, two[0]]})
    assert err.value.field == "limits.gpu_budgets[2]"


def test_a_disallowed_class_is_refused_or_demoted_at_submit(db: Database) -> None:
    create_team(db)
    create_node(db)
    _set(db, "team-a", {"allowed_classes": ["NORMAL", "LOW"], "disallowed": "refuse"})
    with pytest.raises(ValidationFailed) as err:
        submit(db, priority="CRITICAL")
    assert err.value.field == "priority"
    _set(db, "team-a", {"allowed_classes": ["NORMAL", "LOW"], "disallowed": "demote"})
    job = submit(db, priority="CRITICAL")
    with db.read() as s:
        assert s.get(JobRow, job.job_id).priority == "NORMAL"  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["refuse", "demote"])
def test_an_update_to_a_disallowed_class_is_refused(db: Database, mode: str) -> None:
    """``update --priority`` asks for a class by name: refused in either mode (it was
    stored, and status showed the class the team may not use)."""
    from gpufleet.services.jobctl import JobPatch, patch_job

    create_team(db)
    create_node(db)
    job = submit(db, priority="NORMAL")
    _set(db, "team-a", {"allowed_classes": ["NORMAL", "LOW"], "disallowed": mode})
    with pytest.raises(ValidationFailed) as err:
        db.run_write(lambda s: patch_job(s, "team-a", job.job_id, JobPatch(priority="CRITICAL")))
    assert err.value.field == "priority"
    assert "allowed: NORMAL, LOW" in str(err.value)
    db.run_write(lambda s: patch_job(s, "team-a", job.job_id, JobPatch(priority="LOW")))
    with db.read() as s:
        assert s.get(JobRow, job.job_id).priority == "LOW"  # type: ignore[union-attr]


def test_a_live_pass_holds_a_team_over_its_hard_budget_and_sees_a_limits_change(
    db: Database, tmp_path: Path
) -> None:
    """The scheduler reads the teams' limits with its snapshot's teams: a hard GPU-hour
    budget spent holds the team's job PENDING (``budget_exhausted``), and the budget
    removed lets the next pass place it."""
    from gpufleet.controller.leadership import Leadership
    from gpufleet.controller.scheduler import Scheduler
    from gpufleet.objectstore import ObjectStore
    from gpufleet.settings import Settings
    from tests.factories import become_leader

    create_team(db)
    create_node(db)
    start = datetime.now(UTC) - timedelta(hours=2)
    _record(db, "r-spent", "NORMAL", start, start + timedelta(hours=1), 2)  # 2 GPU-h
    _set(db, "team-a", {"gpu_budgets": [{"gpu_hours": 1, "period": "month", "hard": True}]})
    job = submit(db)
    epoch = become_leader(db, "limits-test", lease_s=3600)
    sched = Scheduler(
        db,
        ObjectStore(str(tmp_path / "objects")),
        Settings(data_dir=tmp_path),
        Leadership("limits-test", epoch),
        _NoAgent(),  # type: ignore[arg-type]
    )
    try:
        assert sched.run_pass().placed == 0
        with db.read() as s:
            row = s.get(JobRow, job.job_id)
            assert row is not None and row.status == "PENDING"
            assert (row.pending_reason or {}).get("code") == "budget_exhausted", row.pending_reason
        _set(db, "team-a", {})
        assert sched.run_pass().placed == 1
    finally:
        sched.close()


class _NoAgent:
    def assign(self, node_id: str, address: str, req: object) -> object:
        from gpufleet.rpc.protos import fleet_pb2 as pb

        return pb.AssignJobResponse(result=pb.AssignJobResponse.STARTED)


def test_suggest_a_lower_class_for_a_job_its_class_budget_holds(db: Database) -> None:
    """``why --suggest`` (``services.suggest``, the store's snapshot and ledger): a CRITICAL
    job held by its spent CRITICAL budget (``over: hold``) on a fleet with free GPUs is told
    that HIGH starts it now; applied, it starts as it is."""
    from gpufleet.services.jobctl import JobPatch, patch_job
    from gpufleet.services.suggest import job_suggestions
    from gpufleet.store.dialect import db_now

    create_team(db)
    create_node(db)
    hold = {"gpu_hours": 10, "window_s": 86400, "over": "hold"}
    _set(db, "team-a", {"class_budgets": {"CRITICAL": hold}})
    with db.read() as s:
        now = db_now(s)
    _record(db, "r1", "CRITICAL", now - timedelta(hours=3), now - timedelta(hours=1), 8)
    job = submit(db, priority="CRITICAL", gpus=2)
    answer = job_suggestions(db, "team-a", job.job_id)
    (one,) = answer["suggestions"]
    assert (one["kind"], one["change"], one["node_ids"]) == (
        "priority",
        {"priority": "HIGH"},
        ["n1"],
    )
    assert answer["none_reason"] is None
    db.run_write(lambda s: patch_job(s, "team-a", job.job_id, JobPatch(priority="HIGH")))
    assert job_suggestions(db, "team-a", job.job_id)["starts_as_is"] is True
