"""DD9 on both databases: node images from heartbeats reach the live snapshot and break
placement ties; pre-pull requests are handed out once; start phases are stored on confirm."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place
from gpufleet.services import nodes, runs
from gpufleet.services.jobs import submit_job
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from gpufleet.store.tables import JobRunRow, NodeRow, SchedulingEventRow
from tests.factories import become_leader, create_node, create_team
from tests.store.test_allocate import reserve

IMAGE = "registry.local:5000/team/train:1"


def beat(db: Database, node_id: str, images: list[dict] | None) -> nodes.HeartbeatVerdict:
    return db.run_write(lambda s: nodes.heartbeat(s, node_id, 1, [], images=images))


def submit_image_job(db: Database, image: str | None) -> str:
    spec = JobSpec(
        command=("true",), resources=Resources(2), priority=PriorityClass.NORMAL, image=image
    )
    return submit_job(db, team_id="team-a", idempotency_key=str(uuid.uuid4()), spec=spec).job_id  # type: ignore[attr-defined]


def test_heartbeat_images_reach_the_snapshot_and_break_the_tie(db: Database) -> None:
    create_team(db)
    create_node(db, "n1")
    create_node(db, "n2")
    beat(db, "n2", [{"name": IMAGE, "digest": "sha256:ab", "size_bytes": 10}])
    beat(db, "n1", None)  # not reported: n1 keeps what it had (nothing)
    job_id = submit_image_job(db, IMAGE)
    plain = submit_image_job(db, None)
    with db.snapshot() as s:
        snap = load_snapshot(s, db_now(s))
    by_id = {n.node_id: n for n in snap.nodes}
    assert by_id["n2"].images == frozenset({IMAGE}) and by_id["n1"].images == frozenset()
    assert {p.job_id: p.image for p in snap.pending} == {job_id: IMAGE, plain: None}
    placed = {d.job_id: d.node_id for d in schedule(snap).decisions if isinstance(d, Place)}
    assert placed[job_id] == "n2"


def test_prepull_is_asked_of_healthy_nodes_lacking_the_image_and_delivered_once(
    db: Database,
) -> None:
    create_node(db, "n1", gpu_type="H100")
    create_node(db, "n2", gpu_type="H100")
    create_node(db, "n3", gpu_type="A100")
    beat(db, "n2", [{"name": IMAGE, "digest": "sha256:ab", "size_bytes": 10}])
    asked = db.run_write(lambda s: nodes.prepull_images(s, IMAGE, "H100"))
    assert asked == ["n1"]
    assert beat(db, "n1", []).prepull == (IMAGE,)
    assert beat(db, "n1", []).prepull == ()
    assert beat(db, "n3", []).prepull == ()
    with pytest.raises(ValidationFailed) as err:
        db.run_write(lambda s: nodes.prepull_images(s, "bad image", None))
    assert err.value.field == "image"
    with db.read() as s:
        assert s.get(NodeRow, "n1").prepull is None


def test_confirm_stores_start_phases_and_records_an_event(db: Database) -> None:
    create_team(db)
    create_node(db, "n1")
    epoch = become_leader(db)
    job_id = submit_image_job(db, IMAGE)
    r = reserve(db, job_id, "n1", 2, epoch=epoch)
    phases = {
        "runtime": "container",
        "image": "cold",
        "pull_s": 2.5,
        "create_s": 0.1,
        "start_s": 0.2,
    }

    def confirm(s):
        return runs.confirm_assignment(s, r.run_id, r.token, 42, start_phases=phases)

    assert db.run_write(confirm) == runs.Confirm.CONFIRMED
    db.run_write(confirm)  # repeat
    with db.read() as s:
        assert s.get(JobRunRow, r.run_id).start_phases == phases
        events = s.scalars(
            select(SchedulingEventRow).where(
                SchedulingEventRow.run_id == r.run_id, SchedulingEventRow.kind == "start_phases"
            )
        ).all()
    assert len(events) == 1
    assert "container, cold image: pull 2.50 s" in events[0].message
    assert events[0].details == phases
