"""Invariant 6, nothing stays stuck: the checker (and `gpufleet admin check`) reports stuck
attempts by job id, on both databases. Times are moved into the past by editing the time
columns (never a status), so no test waits."""

from __future__ import annotations

import re
from datetime import timedelta

from sqlalchemy import update

from gpufleet.domain.states import NodeStatus
from gpufleet.services import nodes, runs
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import check_database
from gpufleet.store.tables import JobRunRow
from tests.store.test_allocate import reserve
from tests.store.test_runs import setup


def _findings(db: Database) -> list[tuple[int, str, str, str]]:
    _, found = check_database(db, grace_s=30, confirm_timeout_s=30, margin_s=30)
    return [(v.invariant, v.subject, v.severity, v.message) for v in found]


def _age(db: Database, run_id: str, column: str, seconds: float) -> None:
    db.run_write(
        lambda s: s.execute(
            update(JobRunRow)
            .where(JobRunRow.id == run_id)
            .values({column: db_now(s) - timedelta(seconds=seconds)})
        )
    )


def test_an_attempt_stopping_too_long_is_a_violation_naming_the_job(db: Database) -> None:
    job_id, epoch = setup(db)
    r = reserve(db, job_id, "n1", 2, epoch=epoch)
    db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
    assert db.run_write(
        lambda s: runs.request_stop(s, r.run_id, r.token, "cancel", message="test")
    )
    assert _findings(db) == []  # within grace + margin: fine
    _age(db, r.run_id, "stop_requested_at", 61)
    ((inv, subject, severity, message),) = _findings(db)
    assert (inv, subject, severity) == (6, job_id, "violation")
    stopping = re.search(r"stopping for (\d+) s", message)
    assert r.run_id in message and stopping and 61 <= int(stopping.group(1)) <= 63, message
    assert check_database(db)[1] == []  # without limits: invariants 1-4 only


def test_an_unconfirmed_attempt_past_the_confirm_timeout_is_a_warning(db: Database) -> None:
    job_id, epoch = setup(db)
    r = reserve(db, job_id, "n1", 2, epoch=epoch)
    assert _findings(db) == []
    _age(db, r.run_id, "created_at", 90)
    ((inv, subject, severity, message),) = _findings(db)
    assert (inv, subject, severity) == (6, job_id, "warning")
    # aged 90 s in one transaction, read in the next: a loaded machine may add a second
    found = re.search(r"unconfirmed for (\d+) s \(confirm timeout 30 s\)", message)
    assert found and 90 <= int(found.group(1)) <= 92, message


def test_gpus_held_for_a_run_the_agent_does_not_list_is_a_warning(db: Database) -> None:
    job_id, epoch = setup(db)
    r = reserve(db, job_id, "n1", 2, epoch=epoch)
    db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
    listed = [nodes.HeartbeatRun(r.run_id, job_id, r.token, "RUNNING")]
    db.run_write(lambda s: nodes.heartbeat(s, "n1", 1, listed, nodes.NodeHealth()))
    _age(db, r.run_id, "started_at", 60)
    assert _findings(db) == []  # the agent lists it
    db.run_write(lambda s: nodes.heartbeat(s, "n1", 1, [], nodes.NodeHealth()))
    ((inv, subject, severity, message),) = _findings(db)
    assert (inv, subject, severity) == (6, job_id, "warning")
    assert "does not" in message and "know it" in message


def test_a_quarantined_node_is_not_placeable_and_its_fenced_gpus_stay_held(
    db: Database,
) -> None:
    """Fencing (services.nodes.fence_node) on both databases: the attempt FENCED, the job
    back to PENDING with no user retry used, the GPUs QUARANTINED (still held: invariant 1
    counts them), until a heartbeat that does not list the run releases them."""
    job_id, epoch = setup(db, max_retries=0)
    r = reserve(db, job_id, "n1", 2, epoch=epoch)
    db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
    fenced = db.run_write(
        lambda s: nodes.fence_node(
            s,
            "n1",
            reason="test",
            max_node_failures=3,
            node_to=NodeStatus.QUARANTINED,
            leader_holder="test-leader",
            leader_epoch=epoch,
        )
    )
    assert [(f.run_id, f.job_status) for f in fenced] == [(r.run_id, "PENDING")]
    view, found = check_database(db)
    assert found == []
    (cap,) = view.nodes
    assert cap.available_gpus == 6
    verdict = db.run_write(lambda s: nodes.heartbeat(s, "n1", 1, [], nodes.NodeHealth()))
    view, found = check_database(db)
    assert found == [] and view.nodes[0].available_gpus == 8
    # the released run is also stopped: the agent tombstones it, so a late copy of its
    # AssignJob (held in a frozen node's socket buffer) is refused instead of starting it
    assert [(h.run_id, h.token) for h in verdict.stop] == [(r.run_id, r.token)]
    again = db.run_write(lambda s: nodes.heartbeat(s, "n1", 1, [], nodes.NodeHealth()))
    assert again.stop == ()  # once: the reservation is released now


def test_admin_check_reports_a_stuck_stop_by_job_id(tmp_path) -> None:
    """Issue 7, failure 1's last symptom: `gpufleet admin check` said "no violations" while an
    attempt was stuck PREEMPTING."""
    from typer.testing import CliRunner

    from gpufleet.cli.main import app
    from gpufleet.store.migrate import migrate

    db = Database(f"sqlite:///{tmp_path / 'gpufleet.db'}")
    migrate(db)
    job_id, epoch = setup(db)
    r = reserve(db, job_id, "n1", 8, epoch=epoch)
    db.run_write(lambda s: runs.request_stop(s, r.run_id, r.token, "cancel", message="test"))
    _age(db, r.run_id, "stop_requested_at", 3600)
    result = CliRunner().invoke(app, ["admin", "check", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert f"invariant 6 [{job_id}]" in result.output
    db.dispose()


def test_a_heartbeat_answers_the_leases_epoch_not_a_jobs_token(db: Database) -> None:
    """The heartbeat answer's leader epoch is the lease's (read from the database), also when
    the agent lists runs whose jobs carry higher fencing tokens."""
    job_id, epoch = setup(db, max_retries=5)
    for seen in range(3):  # three attempts: the job's token becomes 3
        r = reserve(db, job_id, "n1", 2, epoch=epoch, seen=seen)
        if seen < 2:
            runs.complete_run(
                db,
                None,  # type: ignore[arg-type]  # NEVER_STARTED reads no manifest
                runs.Report("n1", r.run_id, r.token, runs.Outcome.NEVER_STARTED, 0, ""),
            )
    listed = [nodes.HeartbeatRun(r.run_id, job_id, r.token, "RUNNING")]
    verdict = db.run_write(lambda s: nodes.heartbeat(s, "n1", 1, listed, nodes.NodeHealth()))
    assert r.token == 3 and epoch == 1
    assert verdict.leader_epoch == epoch


def test_a_stop_on_a_silent_node_waits_for_the_fence(db: Database) -> None:
    """Issue 24 item 5: a stop whose node went silent waits for the fence, as designed: no
    violation until the node's last heartbeat + fence timeout + one heartbeat + margin."""
    from gpufleet.store.tables import NodeRow

    job_id, epoch = setup(db)
    r = reserve(db, job_id, "n1", 2, epoch=epoch)
    db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
    assert db.run_write(
        lambda s: runs.request_stop(s, r.run_id, r.token, "cancel", message="test")
    )

    def found() -> list[str]:
        _, out = check_database(
            db,
            grace_s=3,
            confirm_timeout_s=30,
            margin_s=30,
            fence_after_s=60,
            heartbeat_interval_s=10,
        )
        return [v.message for v in out if v.severity == "violation"]

    def silent_for(seconds: float) -> None:
        db.run_write(
            lambda s: s.execute(
                update(NodeRow)
                .where(NodeRow.id == "n1")
                .values(last_heartbeat_at=db_now(s) - timedelta(seconds=seconds))
            )
        )

    _age(db, r.run_id, "stop_requested_at", 47)  # the "stopping for 47 s"
    silent_for(48)
    assert found() == []  # the fence comes at 60 + 10 s of silence; + 30 s margin
    _age(db, r.run_id, "stop_requested_at", 99)
    silent_for(100)
    (message,) = found()
    assert "stopping for 99 s" in message and "its node n1 silent for 100 s" in message
    silent_for(1)  # heard again: the agent got the stop and had grace + margin for it
    assert found() and "grace 3 s" in found()[0]
