"""A node drained for a change of GPUs is marked by ``nodes.reported_gpus``/``reported_gpu_type``
(what its agent last reported), not by the words its reason ends with; on SQLite and real
PostgreSQL, with the migration that adds the columns (0007i) taken down and up again."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import inspect, text

from gpufleet.domain.errors import Conflict
from gpufleet.domain.states import NodeStatus
from gpufleet.services.nodes import (
    INVENTORY_DRAIN,
    operator_fence,
    set_node_status,
    set_status_reason,
)
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.migrate import alembic_config
from gpufleet.store.tables import NodeCapacityRow, NodeRow
from tests.factories import become_leader, create_node, create_team, submit


def _node(db: Database, node_id: str = "n1") -> dict[str, object]:
    with db.read() as s:
        node, cap = s.get(NodeRow, node_id), s.get(NodeCapacityRow, node_id)
        assert node is not None and cap is not None
        return {
            "status": node.status,
            "reason": node.status_reason,
            "reported": (node.reported_gpus, node.reported_gpu_type),
            "recorded": (cap.total_gpus, node.gpu_type),
        }


def _busy_node(db: Database, gpus: int = 8) -> str:
    """n1 with ``gpus`` H100s, 2 of them reserved by a run; returns the run id."""
    create_team(db)
    create_node(db, "n1", gpus=gpus)
    epoch = become_leader(db)
    job = submit(db, gpus=2).job_id
    return db.run_write(
        lambda s: allocate.reserve(
            s,
            job_id=job,
            node_id="n1",
            gpu_count=2,
            seen_fencing_epoch=0,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
            now=db_now(s),
        )
    ).run_id


def _release(db: Database, run_id: str) -> None:
    """The run's GPUs back (its attempt stays active: ``finish_drains`` would wait for it)."""
    db.run_write(lambda s: allocate.release(s, run_id=run_id, now=db_now(s), message="t"))


def _move(db: Database, to: NodeStatus, reason: str | None = None) -> str:
    return db.run_write(
        lambda s: set_node_status(s, "n1", to, message="by an operator", reason=reason)
    )


class TestTheDrainSetsAndClearsTheColumns:
    @pytest.mark.parametrize(
        ("gpus", "gpu_type", "want_reported"),
        [
            pytest.param(4, "H100", (4, "H100"), id="fewer GPUs"),
            pytest.param(8, "A100", (8, "A100"), id="another GPU type"),
        ],
    )
    def test_a_change_while_reserved_is_kept_in_the_columns(
        self, db: Database, gpus: int, gpu_type: str, want_reported: tuple[int, str]
    ) -> None:
        _busy_node(db)
        create_node(db, "n1", gpus=gpus, gpu_type=gpu_type)
        got = _node(db)
        assert (got["status"], got["reported"], got["recorded"]) == (
            NodeStatus.DRAINING,
            want_reported,
            (8, "H100"),
        )
        assert str(got["reason"]).endswith(INVENTORY_DRAIN)  # people still read why

    def test_a_change_while_nothing_is_reserved_is_recorded_and_sets_nothing(
        self, db: Database
    ) -> None:
        create_node(db, "n1", gpus=8)
        create_node(db, "n1", gpus=4)
        got = _node(db)
        assert (got["status"], got["reported"], got["recorded"]) == (
            NodeStatus.HEALTHY,
            (None, None),
            (4, "H100"),
        )

    def test_the_agent_back_at_its_recorded_gpus_clears_them(self, db: Database) -> None:
        _busy_node(db)
        create_node(db, "n1", gpus=4)
        create_node(db, "n1", gpus=8)
        assert _node(db) == {
            "status": NodeStatus.HEALTHY,
            "reason": None,
            "reported": (None, None),
            "recorded": (8, "H100"),
        }

    def test_the_registration_after_the_drain_records_the_gpus_and_clears_them(
        self, db: Database
    ) -> None:
        run_id = _busy_node(db)
        create_node(db, "n1", gpus=4)
        _release(db, run_id)
        _move(db, NodeStatus.CORDONED, reason="drained")  # as the reconciler's drain would
        assert _node(db)["reported"] == (4, "H100")
        create_node(db, "n1", gpus=4)
        got = _node(db)
        assert (got["status"], got["reported"], got["recorded"]) == (
            NodeStatus.CORDONED,
            (None, None),
            (4, "H100"),
        )
        assert "uncordon it" in str(got["reason"])
        _move(db, NodeStatus.HEALTHY)
        assert _node(db)["status"] == NodeStatus.HEALTHY

    def test_another_change_during_the_drain_replaces_them_and_says_it_once(
        self, db: Database
    ) -> None:
        _busy_node(db)
        create_node(db, "n1", gpus=4)
        create_node(db, "n1", gpus=2)
        got = _node(db)
        assert (got["status"], got["reported"]) == (NodeStatus.DRAINING, (2, "H100"))
        assert str(got["reason"]).count(INVENTORY_DRAIN) == 1
        assert "now reports 2 H100" in str(got["reason"])


class TestUncordon:
    def test_an_operators_reason_ending_with_the_old_marker_words_does_not_block_it(
        self, db: Database
    ) -> None:
        """The failure class of the old text marker: an operator's words decided the state."""
        create_node(db, "n1", gpus=8)
        _move(db, NodeStatus.CORDONED, reason=f"swap PSU; {INVENTORY_DRAIN}")
        assert _node(db)["reported"] == (None, None)
        assert _move(db, NodeStatus.HEALTHY) == NodeStatus.CORDONED
        assert _node(db)["status"] == NodeStatus.HEALTHY

    def test_refused_while_the_columns_are_set_whatever_the_reason_says(
        self, db: Database
    ) -> None:
        run_id = _busy_node(db)
        create_node(db, "n1", gpus=4)
        _release(db, run_id)
        _move(db, NodeStatus.CORDONED, reason="drained")
        with pytest.raises(Conflict, match=r"restart its agent") as refused:
            _move(db, NodeStatus.HEALTHY)
        assert "now reports 4 H100 GPU(s) (8 recorded)" in str(refused.value)
        # another path rewrites the reason: the state does not go with the words
        db.run_write(lambda s: set_status_reason(s, "n1", "rack 7 maintenance"))
        with pytest.raises(Conflict, match=r"restart its agent"):
            _move(db, NodeStatus.HEALTHY)
        assert _node(db)["status"] == NodeStatus.CORDONED

    def test_an_operators_cordon_during_the_drain_keeps_the_columns_and_says_why(
        self, db: Database
    ) -> None:
        _busy_node(db)
        create_node(db, "n1", gpus=4)
        _move(db, NodeStatus.CORDONED, reason="drained")
        got = _node(db)
        assert got["reported"] == (4, "H100")
        assert got["reason"] == (
            f"drained; node n1 now reports 4 H100 GPU(s) (8 recorded); {INVENTORY_DRAIN}"
        )

    def test_an_operator_fence_keeps_the_columns_until_the_agent_registers(
        self, db: Database
    ) -> None:
        """A fence rewrites the reason (it used to erase the text marker with it, and the
        node could be unfenced onto GPUs its agent does not have)."""
        _busy_node(db)
        create_node(db, "n1", gpus=4)
        db.run_write(lambda s: operator_fence(s, "n1", reason="dead", max_node_failures=3))
        got = _node(db)
        assert (got["status"], got["reported"]) == (NodeStatus.FENCED, (4, "H100"))
        with pytest.raises(Conflict, match=r"restart its agent"):
            _move(db, NodeStatus.HEALTHY)
        create_node(db, "n1", gpus=4)  # the fence gave the GPUs back: recorded
        got = _node(db)
        assert (got["status"], got["reported"], got["recorded"]) == (
            NodeStatus.FENCED,
            (None, None),
            (4, "H100"),
        )
        assert str(got["reason"]).startswith("operator fence: dead")
        assert _move(db, NodeStatus.HEALTHY) == NodeStatus.FENCED


def _alembic(db: Database, fn: str, rev: str) -> None:
    cfg = alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        getattr(command, fn)(cfg, rev)


def _node_schema(db: Database) -> tuple[set[str], set[str]]:
    """The columns of ``nodes`` and the names of its triggers."""
    triggers = (
        "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'nodes'"
        if db.is_sqlite
        else "SELECT tgname FROM pg_trigger WHERE tgrelid = 'nodes'::regclass AND NOT tgisinternal"
    )
    with db.engine.connect() as conn:
        columns = {c["name"] for c in inspect(conn).get_columns("nodes")}
        return columns, set(conn.execute(text(triggers)).scalars())


def test_the_migration_goes_down_to_0007a_and_up_again(db: Database) -> None:
    """Down drops the two columns, up adds them back, and neither rebuilds ``nodes`` (which
    would drop its change_seq triggers on SQLite)."""
    columns, triggers = _node_schema(db)
    assert {"reported_gpus", "reported_gpu_type"} <= columns
    assert triggers >= {"nodes_change_seq_ins", "nodes_change_seq_upd"}
    create_node(db, "n1", gpus=8)
    try:
        _alembic(db, "downgrade", "0007a")
        later = {"gpu_sharing"}  # added by a later migration (0012_frac27), gone too
        assert _node_schema(db) == (
            columns - {"reported_gpus", "reported_gpu_type"} - later,
            triggers,
        )
    finally:
        _alembic(db, "upgrade", "head")  # the PostgreSQL database is the worker's, shared
    assert _node_schema(db) == (columns, triggers)
    assert _node(db)["recorded"] == (8, "H100")  # the row kept through both
