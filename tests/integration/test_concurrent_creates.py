"""Twelve concurrent creates of one new team over HTTP against a real ``gpufleet server`` on
PostgreSQL (issue 24, item 4): on main, 11 of 12 ``POST /v1/admin/tokens`` with
``create_team`` answered 500 (UniqueViolation) and ``POST /v1/admin/teams`` 1-2 of 12. Every
answer must be 2xx or 409 now: the tokens all made (201), the team created once (one 201,
eleven 409)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from gpufleet.services import auth
from gpufleet.store.db import Database
from tests.integration.server_proc import ServerProcess

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(120)]


def post_at_once(url: str, admin: str, path: str, bodies: list[dict[str, object]]) -> list[int]:
    """POST each body from its own thread and connection, released together."""
    barrier = threading.Barrier(len(bodies))
    codes: list[int] = [0] * len(bodies)

    def one(i: int) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as c:
            c.get("/healthz")  # connected before the barrier: the POSTs start together
            barrier.wait()
            codes[i] = c.post(path, json=bodies[i], timeout=30).status_code

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return codes


def test_twelve_concurrent_creates_of_one_team_never_answer_500(
    pg_url: str, tmp_path: Path
) -> None:
    from tests.conftest import _empty

    db = Database(pg_url)
    _empty(db)
    admin = db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    server = ServerProcess(tmp_path, {"GPUFLEET_DATABASE_URL": pg_url}).start()
    try:
        for round_ in range(3):  # a race may be missed once; three rounds, three new teams
            team = f"new-{round_}"
            codes = post_at_once(
                server.url,
                admin,
                "/v1/admin/tokens",
                [{"team": team, "name": f"t{i}", "create_team": True} for i in range(12)],
            )
            assert codes == [201] * 12, codes
            with db.read() as s:
                assert len(auth.list_tokens(s, team)) == 12
            codes = post_at_once(
                server.url, admin, "/v1/admin/teams", [{"name": f"other-{round_}"}] * 12
            )
            assert sorted(codes) == [201] + [409] * 11, codes
        assert "UniqueViolation" not in server.log()
    finally:
        server.stop()
        db.dispose()
