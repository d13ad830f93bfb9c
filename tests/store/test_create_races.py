"""Creates that two callers race on (issue 24, item 4): a team, the fleet CA record, a new
node's registration. Each was a read and then an insert: the second of two concurrent
transactions read "absent" too, and its INSERT then failed with a unique violation (HTTP 500
from the API). The race is replayed deterministically: transaction A creates and stays open;
B starts in a thread (it reads nothing yet committed, then its INSERT waits for A on
PostgreSQL; SQLite serializes the writers); A commits; B must answer as for an existing row
(409, "already there", a refreshed registration), never with an IntegrityError."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict
from gpufleet.domain.types import GpuDevice
from gpufleet.services import auth, fleet_ca
from gpufleet.services.node_register import NodeInventory, register_node
from gpufleet.store.db import Database
from gpufleet.store.tables import NodeCapacityRow, NodeGpuRow, NodeRow, TeamRow

pytestmark = pytest.mark.timeout(60)


def race(db: Database, first: Callable[[Session], Any], second: Callable[[Session], Any]) -> Any:
    """Run ``first`` in an open transaction, start ``second`` in a thread while it is open,
    commit ``first``; returns what ``second`` returned, or raises what it raised."""
    out: dict[str, Any] = {}

    def run_second() -> None:
        try:
            out["value"] = db.run_write(second)
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    with db.write_tx() as s:
        first(s)
        t = threading.Thread(target=run_second)
        t.start()
        time.sleep(0.4)  # B reads "absent" and waits on A's row (PostgreSQL) or lock (SQLite)
    t.join(timeout=30)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    return out.get("value")


class TestTeamCreate:
    def test_a_second_create_of_the_same_team_is_a_conflict(self, db: Database) -> None:
        with pytest.raises(Conflict, match="already exists"):
            race(
                db,
                lambda s: auth.create_team(s, "vision"),
                lambda s: auth.create_team(s, "vision"),
            )
        with db.read() as s:
            assert s.scalar(select(func.count()).select_from(TeamRow)) == 1

    def test_a_token_with_create_team_for_a_team_being_created_is_made(self, db: Database) -> None:
        raw = race(
            db,
            lambda s: auth.create_token(s, "vision", create_team_if_missing=True),
            lambda s: auth.create_token(s, "vision", create_team_if_missing=True),
        )
        assert raw.startswith("gft_")
        with db.read() as s:
            assert len(auth.list_tokens(s, "vision")) == 2
            assert auth.authenticate(s, raw).team_id == "vision"

    def test_twelve_threads_create_one_team_once(self, db: Database) -> None:
        barrier = threading.Barrier(12)
        results: list[str] = []

        def create() -> None:
            barrier.wait()
            try:
                db.run_write(lambda s: auth.create_team(s, "nlp"))
                results.append("created")
            except Conflict:
                results.append("conflict")
            except Exception as exc:  # recorded for the assertion
                results.append(type(exc).__name__)

        threads = [threading.Thread(target=create) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(results) == ["conflict"] * 11 + ["created"], results


class TestFleetCaRecord:
    def test_two_controllers_recording_one_ca_at_once(self, db: Database) -> None:
        written = race(
            db,
            lambda s: fleet_ca.record_ca(s, "a" * 64, where="x"),
            lambda s: fleet_ca.record_ca(s, "a" * 64, where="y"),
        )
        assert written is False

    def test_another_ca_recorded_at_once_is_a_conflict(self, db: Database) -> None:
        with pytest.raises(Conflict, match="fleet CA"):
            race(
                db,
                lambda s: fleet_ca.record_ca(s, "a" * 64, where="x"),
                lambda s: fleet_ca.record_ca(s, "b" * 64, where="the CA in /y"),
            )
        with db.read() as s:
            recorded = fleet_ca.recorded_ca(s)
            assert recorded is not None and recorded.fingerprint == "a" * 64


def inventory(address: str, epoch: int = 1) -> NodeInventory:
    gpus = tuple(GpuDevice(i, f"GPU-{i}", "A100", 40_000) for i in range(2))
    return NodeInventory("n1", address, epoch, gpus, 8.0, 64_000, {}, "declared")


class TestNodeRegistration:
    def test_two_registrations_of_a_new_node_at_once(self, db: Database) -> None:
        race(
            db,
            lambda s: register_node(s, inventory("10.0.0.1:7000")),
            lambda s: register_node(s, inventory("10.0.0.2:7000")),
        )
        with db.read() as s:
            node = s.get(NodeRow, "n1")
            assert node is not None and node.address == "10.0.0.2:7000"  # the later refresh
            cap = s.get(NodeCapacityRow, "n1")
            assert cap is not None and (cap.total_gpus, cap.available_gpus) == (2, 2)
            assert s.scalar(select(func.count()).select_from(NodeGpuRow)) == 2
