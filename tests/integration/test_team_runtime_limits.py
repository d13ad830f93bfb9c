"""Per-team default and maximum ``max_runtime_s`` (Slurm's DefaultTime/MaxTime) over ASGI
on both databases: set by the admin API, applied at submit (the default filled in when the
user gave none, above the limit a 422 naming ``max_runtime_s`` with the limit), and the admin
CLI flags that set them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from tests.factories import create_node
from tests.integration.server_proc import ServerProcess
from tests.integration.test_api_limits import make_client, put_team

JOB = {"command": ["python3", "train.py"], "gpu_count": 1}


@pytest.fixture
def tokens(db: Database) -> dict[str, str]:
    made = {
        team: db.run_write(lambda s, t=team: auth.create_token(s, t, create_team_if_missing=True))
        for team in ("vision", "nlp")
    }
    made["admin"] = db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    create_node(db, "n1", gpus=8)
    return made


def submit(client: TestClient, token: str, key: str, **extra: Any) -> Any:
    return client.post(
        "/v1/jobs",
        json={**JOB, **extra},
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
    )


def job_max_runtime(client: TestClient, token: str, job_id: str) -> Any:
    r = client.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()["max_runtime_s"]


class TestTeamRuntime:
    def test_default_is_filled_in_and_the_limit_refuses(
        self, db: Database, tokens: dict[str, str], tmp_path: Path
    ) -> None:
        with make_client(db, tmp_path) as client:
            r = put_team(
                client,
                tokens["admin"],
                "nlp",
                {"default_max_runtime_s": 3600, "max_runtime_limit_s": 86400},
            )
            assert r.status_code == 200, r.text
            assert (r.json()["default_max_runtime_s"], r.json()["max_runtime_limit_s"]) == (
                3600.0,
                86400.0,
            )
            # no max_runtime_s: the team's default is the job's bound
            made = submit(client, tokens["nlp"], "k1")
            assert made.status_code == 201, made.text
            assert job_max_runtime(client, tokens["nlp"], made.json()["job_id"]) == 3600.0
            # within the limit: the user's own value
            own = submit(client, tokens["nlp"], "k2", max_runtime_s=7200)
            assert job_max_runtime(client, tokens["nlp"], own.json()["job_id"]) == 7200.0
            # above it: 422 naming the field and the limit
            over = submit(client, tokens["nlp"], "k3", max_runtime_s=90000)
            assert over.status_code == 422
            body = over.json()
            assert body["field"] == "max_runtime_s"
            assert "86400" in body["message"] and "max_runtime_limit_s" in body["message"]
            # another team is unaffected
            other = submit(client, tokens["vision"], "v1", max_runtime_s=90000)
            assert other.status_code == 201
            assert job_max_runtime(client, tokens["vision"], other.json()["job_id"]) == 90000.0
            free = submit(client, tokens["vision"], "v2")
            assert job_max_runtime(client, tokens["vision"], free.json()["job_id"]) is None

    def test_zero_removes_them(self, db: Database, tokens: dict[str, str], tmp_path: Path) -> None:
        with make_client(db, tmp_path) as client:
            admin = tokens["admin"]
            put_team(
                client, admin, "nlp", {"default_max_runtime_s": 60, "max_runtime_limit_s": 60}
            )
            r = put_team(
                client, admin, "nlp", {"default_max_runtime_s": 0, "max_runtime_limit_s": 0}
            )
            assert (r.json()["default_max_runtime_s"], r.json()["max_runtime_limit_s"]) == (
                None,
                None,
            )
            made = submit(client, tokens["nlp"], "k1", max_runtime_s=1e6)
            assert made.status_code == 201

    def test_the_maximum_binds_updates_and_is_the_default_without_one(
        self, db: Database, tokens: dict[str, str], tmp_path: Path
    ) -> None:
        """Every path that sets a job's bound obeys the team's maximum: PATCH as submit; and
        a team with a maximum but no default bounds jobs by the maximum (Slurm's MaxTime)."""
        with make_client(db, tmp_path) as client:
            r = put_team(client, tokens["admin"], "nlp", {"max_runtime_limit_s": 3600})
            assert r.status_code == 200, r.text
            made = submit(client, tokens["nlp"], "k1", hold=True)
            assert made.status_code == 201, made.text
            job_id = made.json()["job_id"]
            assert job_max_runtime(client, tokens["nlp"], job_id) == 3600.0
            for who in ("nlp", "admin"):
                over = client.patch(
                    f"/v1/jobs/{job_id}",
                    json={"max_runtime_s": 99_999},
                    headers={"Authorization": f"Bearer {tokens[who]}"},
                )
                assert over.status_code == 422, over.text
                assert over.json()["field"] == "max_runtime_s" and "3600" in over.json()["message"]
            assert job_max_runtime(client, tokens["nlp"], job_id) == 3600.0
            ok = client.patch(
                f"/v1/jobs/{job_id}",
                json={"max_runtime_s": 600},
                headers={"Authorization": f"Bearer {tokens['nlp']}"},
            )
            assert ok.status_code == 200, ok.text
            assert job_max_runtime(client, tokens["nlp"], job_id) == 600.0
            # a name with NUL is refused by PATCH as by submit (it was stored on SQLite)
            nul = client.patch(
                f"/v1/jobs/{job_id}",
                json={"name": "x\u0000"},
                headers={"Authorization": f"Bearer {tokens['nlp']}"},
            )
            assert nul.status_code == 422 and nul.json()["field"] == "name", nul.text

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            pytest.param({"default_max_runtime_s": -1}, "default_max_runtime_s", id="negative"),
            pytest.param({"max_runtime_limit_s": 1e12}, "max_runtime_limit_s", id="too large"),
            pytest.param(
                {"default_max_runtime_s": 7200, "max_runtime_limit_s": 3600},
                "default_max_runtime_s",
                id="default above the limit",
            ),
        ],
    )
    def test_bad_values_get_422_naming_the_field(
        self, db: Database, tokens: dict[str, str], tmp_path: Path, body: Any, field: str
    ) -> None:
        with make_client(db, tmp_path) as client:
            r = put_team(client, tokens["admin"], "nlp", body)
            assert r.status_code == 422, r.text
            assert field in json.dumps(r.json())


@pytest.mark.slow
def test_admin_team_set_runtime_through_the_cli(tmp_path: Path) -> None:
    db = open_database(Settings(data_dir=tmp_path))
    admin = db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    db.dispose()
    server = ServerProcess(tmp_path, {"GPUFLEET_REDIS_URL": ""}).start()
    env = {
        **os.environ,
        "GPUFLEET_URL": server.url,
        "GPUFLEET_TOKEN": admin,
        "GPUFLEET_CONFIG": str(tmp_path / "none.yaml"),
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "admin", *args],
            env=env,
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )

    try:
        assert cli("team", "create", "nlp").returncode == 0
        done = cli("team", "set", "nlp", "--default-runtime", "4h", "--max-runtime", "7d")
        assert done.returncode == 0, done.stderr
        listed = {t["team"]: t for t in json.loads(cli("team", "list", "-o", "json").stdout)}
        got = listed["nlp"]
        assert (got["default_max_runtime_s"], got["max_runtime_limit_s"]) == (14400.0, 604800.0)
        bad = cli("team", "set", "nlp", "--default-runtime", "8d")
        assert bad.returncode == 2 and "default_max_runtime_s" in bad.stderr
        assert "Traceback" not in bad.stderr
        cleared = cli("team", "set", "nlp", "--max-runtime", "none")
        assert cleared.returncode == 0, cleared.stderr
        listed = {t["team"]: t for t in json.loads(cli("team", "list", "-o", "json").stdout)}
        assert listed["nlp"]["max_runtime_limit_s"] is None
    finally:
        server.stop()
