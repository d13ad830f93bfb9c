"""Token list and revoke (REST on both databases, the admin CLI), and revocation seen by
every API replica within 1 s: two real server processes on one PostgreSQL database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gpufleet.api.app import PRINCIPAL_TTL_S, AppState, create_app
from gpufleet.objectstore import ObjectStore
from gpufleet.processes import open_database
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from tests.integration.server_proc import ServerProcess


@pytest.fixture
def api(db: Database, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    app = create_app(
        AppState(Settings(data_dir=tmp_path), db, InProcWaker(), ObjectStore(str(tmp_path / "o")))
    )
    tokens = {
        "admin": db.run_write(
            lambda s: auth.create_token(
                s, "ops", name="root", is_admin=True, create_team_if_missing=True
            )
        ),
        "vision": db.run_write(
            lambda s: auth.create_token(s, "vision", name="ci", create_team_if_missing=True)
        ),
    }
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokens


def auth_hdr(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class TestRest:
    def test_list_never_shows_the_token(self, api) -> None:
        client, tokens = api
        r = client.get("/v1/admin/tokens", headers=auth_hdr(tokens["admin"]))
        assert r.status_code == 200
        items = r.json()["items"]
        assert {(t["team"], t["name"], t["admin"]) for t in items} == {
            ("ops", "root", True),
            ("vision", "ci", False),
        }
        assert tokens["vision"] not in r.text and tokens["admin"] not in r.text
        assert "sha256" not in r.text
        only = client.get("/v1/admin/tokens?team=vision", headers=auth_hdr(tokens["admin"]))
        assert [t["team"] for t in only.json()["items"]] == ["vision"]

    def test_revoke_refuses_the_token_at_once_here(self, api) -> None:
        client, tokens = api
        me = auth_hdr(tokens["vision"])
        assert client.get("/v1/jobs", headers=me).status_code == 200  # cached now
        items = client.get("/v1/admin/tokens", headers=auth_hdr(tokens["admin"])).json()["items"]
        tid = next(t["id"] for t in items if t["team"] == "vision")
        r = client.delete(f"/v1/admin/tokens/{tid}", headers=auth_hdr(tokens["admin"]))
        assert r.status_code == 200 and r.json()["revoked_at"]
        assert client.get("/v1/jobs", headers=me).status_code == 401
        again = client.delete(f"/v1/admin/tokens/{tid}", headers=auth_hdr(tokens["admin"]))
        assert again.status_code == 200 and again.json()["revoked_at"] == r.json()["revoked_at"]
        active = client.get(
            "/v1/admin/tokens?include_revoked=false", headers=auth_hdr(tokens["admin"])
        ).json()["items"]
        assert tid not in [t["id"] for t in active]

    @pytest.mark.parametrize("tid", ["tok-nope", "%00", "x" * 300])
    def test_unknown_token_is_404(self, api, tid) -> None:
        client, tokens = api
        r = client.delete(f"/v1/admin/tokens/{tid}", headers=auth_hdr(tokens["admin"]))
        assert r.status_code == 404 and r.json()["field"] == "token_id"

    def test_members_cannot_list_or_revoke(self, api) -> None:
        client, tokens = api
        me = auth_hdr(tokens["vision"])
        assert client.get("/v1/admin/tokens", headers=me).status_code == 403
        assert client.delete("/v1/admin/tokens/tok-x", headers=me).status_code == 403


@pytest.mark.slow
def test_admin_token_cli(tmp_path: Path) -> None:
    open_database(Settings(data_dir=tmp_path)).dispose()
    boot = subprocess.run(
        [
            *(sys.executable, "-m", "gpufleet.cli.main", "admin", "token", "create", "--db"),
            *("--team", "ops", "--create-team", "--name", "root", "--admin"),
            *("--data-dir", str(tmp_path)),
        ],
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert boot.returncode == 0, boot.stderr  # the first admin token: on the database host
    server = ServerProcess(tmp_path, {"GPUFLEET_REDIS_URL": ""}).start()
    env = {
        **os.environ,
        "GPUFLEET_URL": server.url,
        "GPUFLEET_TOKEN": boot.stdout.strip().splitlines()[-1],
        "GPUFLEET_CONFIG": str(tmp_path / "none.yaml"),
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "admin", "token", *args],
            env=env,
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )

    typo = cli("create", "--team", "vision", "--name", "laptop")  # no such team yet
    assert typo.returncode == 2 and "known teams: ops" in typo.stderr, typo.stderr
    made = cli("create", "--team", "vision", "--name", "laptop", "--create-team")
    assert made.returncode == 0, made.stderr
    raw = made.stdout.strip().splitlines()[-1]
    listed = [t for t in json.loads(cli("list", "-o", "json").stdout) if t["team"] != "ops"]
    assert [(t["team"], t["name"], t["revoked_at"]) for t in listed] == [
        ("vision", "laptop", None)
    ]
    assert raw not in cli("list").stdout
    done = cli("revoke", listed[0]["id"])
    assert done.returncode == 0 and "revoked" in done.stdout, done.stderr
    assert json.loads(cli("list", "--team", "vision", "-o", "json").stdout)[0]["revoked_at"]
    assert json.loads(cli("list", "--team", "vision", "--active", "-o", "json").stdout) == []
    missing = cli("revoke", "tok-missing")
    assert missing.returncode == 2 and "no token" in missing.stderr
    assert "Traceback" not in missing.stderr
    # a team token is refused, with a message that says why
    team_token = cli("create", "--team", "vision").stdout.strip().splitlines()[-1]
    refused = cli("list", "--token", team_token)
    assert refused.returncode == 2 and "needs an admin token" in refused.stderr
    server.stop()


@pytest.mark.slow
@pytest.mark.postgres
def test_a_revoked_token_fails_on_every_replica_within_1s(pg_url: str, tmp_path: Path) -> None:
    from tests.conftest import _empty

    db = Database(pg_url)
    _empty(db)
    raw = db.run_write(lambda s: auth.create_token(s, "vision", create_team_if_missing=True))
    for i in range(2):
        (tmp_path / f"r{i}").mkdir()
    replicas = [
        ServerProcess(tmp_path / f"r{i}", {"GPUFLEET_DATABASE_URL": pg_url}) for i in range(2)
    ]
    for r in replicas:
        r.start()
    try:
        clients = [httpx.Client(base_url=r.url, headers=auth_hdr(raw)) for r in replicas]
        for c in clients:  # each replica has the token cached
            assert c.get("/v1/jobs").status_code == 200
        refused_at: list[float | None] = [None, None]
        stop = threading.Event()

        def poll(i: int) -> None:
            while not stop.is_set():
                began = time.monotonic()
                if clients[i].get("/v1/jobs").status_code == 401:
                    refused_at[i] = began
                    return
                time.sleep(0.01)

        threads = [threading.Thread(target=poll, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both replicas are serving the cached token meanwhile
        with db.read() as s:
            tid = auth.list_tokens(s, "vision")[0]["id"]
        db.run_write(lambda s: auth.revoke_token(s, tid))
        revoked = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        stop.set()
        lags = [None if at is None else max(0.0, at - revoked) for at in refused_at]
        print(f"revocation seen by the replicas after {lags} s (cache TTL {PRINCIPAL_TTL_S} s)")
        # a request that starts after the cache TTL always reads the database
        time.sleep(PRINCIPAL_TTL_S)
        assert [c.get("/v1/jobs").status_code for c in clients] == [401, 401]
        assert all(lag is not None and lag < 1.0 for lag in lags), lags
    finally:
        for r in replicas:
            r.stop()
        db.dispose()
