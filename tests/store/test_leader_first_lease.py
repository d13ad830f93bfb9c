"""Two controllers taking the very first leader lease at once (real PostgreSQL)."""

from __future__ import annotations

import threading

import pytest

from gpufleet.store import leader
from gpufleet.store.db import Database


@pytest.mark.postgres
def test_two_first_acquires_racing_leave_one_leader_and_one_follower(pg_url: str) -> None:
    """Both find no lease row (nothing to lock yet) and insert one: the second insert waits on
    the first's primary key and then loses. It must answer "not leader", not raise (a
    controller starting beside another logged a duplicate-key traceback)."""
    from tests.conftest import _empty

    db = Database(pg_url)
    _empty(db)
    results: dict[str, object] = {}
    try:
        with db.write_tx() as first:
            assert leader.try_acquire(first, "ctl-a", 15.0) == 1  # inserted, not committed

            def second() -> None:
                try:
                    with db.write_tx() as s:
                        results["b"] = leader.try_acquire(s, "ctl-b", 15.0)
                except Exception as exc:  # the bug: IntegrityError escaping
                    results["b"] = exc

            t = threading.Thread(target=second)
            t.start()
            t.join(1.0)  # it blocks on the uncommitted row's key until the first commits
            assert t.is_alive(), results
        t.join(10.0)
        assert results["b"] is None, results
        with db.read() as s:
            assert leader.current_epoch(s) == 1
    finally:
        db.dispose()
