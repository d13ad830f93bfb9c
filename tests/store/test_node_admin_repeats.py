"""Operator node actions repeated, on both databases: a second drain of a DRAINING node (and a
second cordon, uncordon) is a no-op, not an illegal transition; a forgotten node, whose row
stays while its attempts name it, is NotFound for every operator action (forget, fence,
cordon, drain, labels, revoke) as an id never seen; heartbeats keep each image name once."""

from __future__ import annotations

from functools import partial

import pytest
from sqlalchemy import func, select

from gpufleet.domain.errors import NotFound
from gpufleet.domain.states import NodeStatus
from gpufleet.objectstore import ObjectStore
from gpufleet.services import node_identity, node_labels, nodes, runs
from gpufleet.store.db import Database
from gpufleet.store.tables import NodeRow, SchedulingEventRow
from tests.factories import become_leader, create_node, create_team, submit
from tests.store.test_allocate import reserve


def _set(db: Database, node_id: str, to: NodeStatus, reason: str | None = None) -> str:
    return db.run_write(
        partial(nodes.set_node_status, node_id=node_id, to=to, message="op", reason=reason)
    )


def _status(db: Database, node_id: str) -> tuple[str, str | None]:
    with db.read() as s:
        node = s.get(NodeRow, node_id)
        assert node is not None
        return node.status, node.status_reason


def _events(db: Database) -> int:
    with db.read() as s:
        return s.scalar(select(func.count()).select_from(SchedulingEventRow)) or 0


@pytest.mark.parametrize(
    ("first", "want_reason"),
    [
        pytest.param(NodeStatus.DRAINING, "still draining", id="drain of a DRAINING node"),
        pytest.param(NodeStatus.CORDONED, "still cordoned", id="cordon of a CORDONED node"),
    ],
)
def test_the_same_operator_status_again_is_a_no_op(
    db: Database, first: NodeStatus, want_reason: str
) -> None:
    create_team(db)
    create_node(db, "n1", gpus=2)
    assert _set(db, "n1", first, "first") == NodeStatus.HEALTHY
    assert _set(db, "n1", first, want_reason) == first  # was: DRAINING -> DRAINING illegal
    assert _status(db, "n1") == (first, want_reason)


def test_uncordon_of_a_healthy_node_is_a_no_op_without_an_event(db: Database) -> None:
    create_team(db)
    create_node(db, "n1", gpus=2)
    before = _events(db)
    assert _set(db, "n1", NodeStatus.HEALTHY) == NodeStatus.HEALTHY
    assert _events(db) == before
    assert _status(db, "n1") == (NodeStatus.HEALTHY, None)


def _forgotten_with_history(db: Database) -> None:
    """n1 ran an attempt, then was forgotten: its row stays (the attempt names it)."""
    create_team(db)
    create_node(db, "n1", gpus=2)
    epoch = become_leader(db)
    r = reserve(db, submit(db, gpus=1).job_id, "n1", 1, epoch=epoch)
    runs.complete_run(
        db,
        ObjectStore("memory://"),
        runs.Report("n1", r.run_id, r.token, runs.Outcome.NEVER_STARTED, 0, ""),
    )
    db.run_write(partial(node_identity.forget_node, node_id="n1"))
    with db.read() as s:
        assert s.get(NodeRow, "n1") is not None


@pytest.mark.parametrize(
    "action",
    [
        pytest.param(partial(node_identity.forget_node, node_id="n1"), id="forget again"),
        pytest.param(
            partial(nodes.operator_fence, node_id="n1", reason="dead", max_node_failures=3),
            id="fence --confirm-dead",
        ),
        pytest.param(
            partial(nodes.set_node_status, node_id="n1", to=NodeStatus.CORDONED, message="x"),
            id="cordon",
        ),
        pytest.param(
            partial(nodes.set_node_status, node_id="n1", to=NodeStatus.DRAINING, message="x"),
            id="drain",
        ),
        pytest.param(
            partial(node_labels.set_admin_labels, node_id="n1", changes={"rack": "r1"}),
            id="label",
        ),
        pytest.param(partial(node_identity.revoke_node, node_id="n1"), id="revoke"),
    ],
)
def test_a_forgotten_node_is_not_found_for_every_operator_action(
    db: Database, action: partial[object]
) -> None:
    _forgotten_with_history(db)
    before = _status(db, "n1")
    with pytest.raises(NotFound, match=r"no node 'n1' \(it was forgotten") as info:
        db.run_write(action)
    assert info.value.field == "node_id"
    assert _status(db, "n1") == before  # never claimed FENCED, CORDONED...


def test_a_forgotten_node_that_joins_again_can_be_forgotten_again(db: Database) -> None:
    _forgotten_with_history(db)
    secret = db.run_write(partial(node_identity.create_join_token, node_id="n1", ttl_s=900))[0]
    from tests.store.test_node_identity import LATER

    db.run_write(
        partial(node_identity.join, secret=secret, node_id="n1", serial="ab01", not_after=LATER)
    )
    assert db.run_write(partial(node_identity.forget_node, node_id="n1")) == 1


def test_a_heartbeat_keeps_each_image_name_once_in_order(db: Database) -> None:
    create_team(db)
    create_node(db, "n1", gpus=1)
    image = {"name": "localhost/py:3.11", "digest": "sha256:1", "size_bytes": 5}
    other = {"name": "127.0.0.1:5000/py:3.11", "digest": "sha256:1", "size_bytes": 5}
    # what an agent before the fix sent for one podman image with two tags
    db.run_write(lambda s: nodes.heartbeat(s, "n1", 1, [], images=[image, other, image, other]))
    with db.read() as s:
        node = s.get(NodeRow, "n1")
        assert node is not None and node.images == [image, other]


def test_the_failure_detector_leaves_a_forgotten_node_alone(db: Database) -> None:
    """A forgotten node's kept row (HEALTHY when forgotten, its agent gone) fell silent, and
    the upkeep moved it to SUSPECT and then fenced it: events for a node not in the fleet."""
    from datetime import timedelta

    from sqlalchemy import update

    from gpufleet.services import node_upkeep
    from gpufleet.store.dialect import db_now

    _forgotten_with_history(db)

    def silence(s: object) -> None:
        old = db_now(s) - timedelta(hours=1)  # type: ignore[arg-type]
        s.execute(update(NodeRow).where(NodeRow.id == "n1").values(last_heartbeat_at=old))  # type: ignore[attr-defined]

    db.run_write(silence)
    before = _events(db)
    assert db.run_write(partial(node_upkeep.mark_silent_nodes_suspect, silent_for_s=60)) == []
    fenced = db.run_write(
        partial(
            node_upkeep.fence_silent_nodes,
            silent_for_s=60,
            max_node_failures=3,
            leader_holder="h",
            leader_epoch=1,
        )
    )
    assert fenced == {}
    assert _status(db, "n1")[0] == NodeStatus.HEALTHY and _events(db) == before
