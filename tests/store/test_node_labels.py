"""Admin-set node labels on both databases: kept apart from the agent's, surviving its
re-registration, winning on a shared key, and what the scheduler's snapshot and admission's
node_selector check see."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from gpufleet.domain.errors import NotFound, ValidationFailed
from gpufleet.domain.types import GpuDevice
from gpufleet.services import job_admission, node_labels, nodes
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from gpufleet.store.tables import SchedulingEventRow

INV = nodes.NodeInventory(
    node_id="n1",
    address="127.0.0.1:1",
    agent_epoch=1,
    gpus=tuple(GpuDevice(i, f"n1-{i}", "H100", 81920) for i in range(8)),
    cpu=64,
    memory_mb=512_000,
    labels={"rack": "r1", "switch": "s1", "gpufleet/containment": "pidns"},
    inventory_source="declared",
)


def register(db: Database, inv: nodes.NodeInventory = INV) -> None:
    db.run_write(lambda s: nodes.register_node(s, inv))


def set_labels(db: Database, changes: dict[str, str | None], replace: bool = False) -> dict:
    return db.run_write(
        partial(node_labels.set_admin_labels, node_id="n1", changes=changes, replace=replace)
    )


def snapshot_labels(db: Database) -> dict[str, str]:
    with db.read() as s:
        snap = load_snapshot(s, db_now(s))
    return dict(next(n for n in snap.nodes if n.node_id == "n1").labels)


class TestAdminLabels:
    def test_admin_label_wins_and_survives_re_registration(self, db: Database) -> None:
        register(db)
        got = set_labels(db, {"rack": "r9", "zone": "z1"})
        assert got["labels"] == {
            "rack": "r9",
            "switch": "s1",
            "zone": "z1",
            "gpufleet/containment": "pidns",
        }
        assert got["admin_labels"] == {"rack": "r9", "zone": "z1"}
        assert got["agent_labels"] == INV.labels

        # The agent restarts and registers again with other labels of its own.
        register(db, replace(INV, agent_epoch=2, labels={"rack": "r1", "switch": "s2"}))
        assert snapshot_labels(db) == {"rack": "r9", "switch": "s2", "zone": "z1"}

    def test_removing_an_admin_label_shows_the_agents_again(self, db: Database) -> None:
        register(db)
        set_labels(db, {"rack": "r9"})
        got = set_labels(db, {"rack": None, "missing": None})
        assert got["admin_labels"] == {}
        assert got["labels"]["rack"] == "r1"
        assert snapshot_labels(db)["rack"] == "r1"

    def test_replace_sets_exactly(self, db: Database) -> None:
        register(db)
        set_labels(db, {"rack": "r9", "zone": "z1"})
        got = set_labels(db, {"switch": "s7"}, replace=True)
        assert got["admin_labels"] == {"switch": "s7"}
        assert got["labels"]["rack"] == "r1"

    def test_changes_are_audited_and_an_empty_patch_is_not(self, db: Database) -> None:
        register(db)
        set_labels(db, {"rack": "r9"})
        set_labels(db, {})
        with db.read() as s:
            events = s.query(SchedulingEventRow).filter_by(kind="node_labels_set").all()
        assert [e.message for e in events] == ["admin labels rack=r9"]

    @pytest.mark.parametrize(
        ("changes", "want_field"),
        [
            pytest.param({"bad key": "x"}, "labels.bad key", id="bad key"),
            pytest.param({"rack": "r/1"}, "labels.rack", id="bad value"),
            pytest.param(
                {"gpufleet/containment": "none"},
                "labels.gpufleet/containment",
                id="agent's prefix",
            ),
        ],
    )
    def test_bad_labels_change_nothing(
        self, db: Database, changes: dict[str, str | None], want_field: str
    ) -> None:
        register(db)
        with pytest.raises(ValidationFailed) as exc:
            set_labels(db, changes)
        assert exc.value.field == want_field
        assert snapshot_labels(db)["rack"] == "r1"

    def test_unknown_node(self, db: Database) -> None:
        with pytest.raises(NotFound):
            set_labels(db, {"rack": "r1"})

    def test_node_selector_admission_sees_admin_labels(self, db: Database) -> None:
        register(db)
        job_admission.forget_fleet_shapes()
        with db.read() as s:
            assert not any(sh.label("zone") == "z1" for sh in job_admission._fleet_shapes(s))
        set_labels(db, {"zone": "z1"})  # forgets the cached shapes
        with db.read() as s:
            assert any(sh.label("zone") == "z1" for sh in job_admission._fleet_shapes(s))
