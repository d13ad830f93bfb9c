"""Per-team admission limits over ASGI on both databases: submit rate (token bucket, in
process and shared through real Redis by two API replicas), unfinished jobs, defaults on,
sanity bounds on quota values (422 naming the field), and the admin CLI that sets them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from gpufleet.api.app import AppState, create_app
from gpufleet.domain.errors import LimitExceeded, ValidationFailed
from gpufleet.objectstore import ObjectStore
from gpufleet.processes import open_database
from gpufleet.queue import InProcWaker
from gpufleet.services import auth, teams
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from tests.conftest import REDIS_URL
from tests.factories import create_node
from tests.integration.server_proc import ServerProcess

JOB = {"command": ["python3", "train.py"], "gpu_count": 1}


def make_client(db: Database, tmp_path: Path, **settings: Any) -> TestClient:
    app = create_app(
        AppState(
            Settings(data_dir=tmp_path, **settings),
            db,
            InProcWaker(),
            ObjectStore(str(tmp_path / "objects")),
        )
    )
    return TestClient(app, raise_server_exceptions=False)


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


def submit(client: TestClient, token: str, key: str) -> Any:
    return client.post(
        "/v1/jobs", json=JOB, headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key}
    )


def put_team(client: TestClient, admin: str, team: str, body: dict[str, Any]) -> Any:
    return client.put(
        f"/v1/admin/teams/{team}", json=body, headers={"Authorization": f"Bearer {admin}"}
    )


class TestSubmitRate:
    def test_a_team_over_its_rate_gets_429_and_others_do_not(self, db, tokens, tmp_path) -> None:
        with make_client(db, tmp_path) as client:
            r = put_team(
                client, tokens["admin"], "nlp", {"submit_rate_per_s": 0.1, "submit_burst": 3}
            )
            assert r.status_code == 200 and r.json()["submit_rate_per_s"] == 0.1
            codes = [submit(client, tokens["nlp"], f"k{i}").status_code for i in range(3)]
            assert codes == [201, 201, 201]
            over = submit(client, tokens["nlp"], "k3")
            assert over.status_code == 429
            assert int(over.headers["Retry-After"]) >= 1
            body = over.json()
            assert body["field"] == "submit_rate_per_s" and "submit rate" in body["message"]
            assert body["error"] == "limit_exceeded"
            for i in range(5):  # another team is unaffected
                assert submit(client, tokens["vision"], f"v{i}").status_code == 201

    def test_limits_are_on_by_default(self, db, tokens, tmp_path) -> None:
        with make_client(db, tmp_path, team_submit_rate_per_s=0.1, team_submit_burst=2) as client:
            codes = [submit(client, tokens["vision"], f"k{i}").status_code for i in range(3)]
            assert codes == [201, 201, 429]
            # 0 = no limit for this team
            assert (
                put_team(client, tokens["admin"], "vision", {"submit_rate_per_s": 0}).json()[
                    "submit_rate_per_s"
                ]
                == 0
            )
            assert submit(client, tokens["vision"], "k9").status_code == 201

    def test_outstanding_default_and_override(self, db, tokens, tmp_path) -> None:
        with make_client(db, tmp_path, team_max_outstanding_jobs=2) as client:
            codes = [submit(client, tokens["vision"], f"k{i}").status_code for i in range(2)]
            over = submit(client, tokens["vision"], "k2")
            assert codes == [201, 201] and over.status_code == 429
            assert over.json()["field"] == "max_outstanding_jobs"
            assert "max_outstanding_jobs" in over.json()["message"]
            assert int(over.headers["Retry-After"]) >= 1
            listed = client.get(
                "/v1/admin/teams", headers={"Authorization": f"Bearer {tokens['admin']}"}
            ).json()["items"]
            assert {t["team"]: t["max_outstanding_jobs"] for t in listed}["vision"] == 2
            put_team(client, tokens["admin"], "vision", {"max_outstanding_jobs": 0})
            assert submit(client, tokens["vision"], "k3").status_code == 201


@pytest.mark.redis
class TestSharedBucket:
    def test_two_replicas_draw_from_one_redis_bucket(self, db, tokens, tmp_path) -> None:
        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter("gpufleet:rate:*"):  # the default GPUFLEET_REDIS_PREFIX
            r.delete(key)
        db.run_write(
            lambda s: teams.update_quota(
                s, "nlp", teams.QuotaUpdate(submit_rate_per_s=0.05, submit_burst=2)
            )
        )
        a = make_client(db, tmp_path / "a", redis_url=REDIS_URL)
        b = make_client(db, tmp_path / "b", redis_url=REDIS_URL)
        with a, b:
            assert submit(a, tokens["nlp"], "k1").status_code == 201
            assert submit(b, tokens["nlp"], "k2").status_code == 201
            # each replica alone would still have a token; together the bucket is empty
            assert submit(a, tokens["nlp"], "k3").status_code == 429
            assert submit(b, tokens["nlp"], "k4").status_code == 429
            assert submit(b, tokens["vision"], "v1").status_code == 201
        assert r.exists("gpufleet:rate:submit:nlp")

    def test_redis_down_falls_back_to_a_per_replica_bucket(self, db, tokens, tmp_path) -> None:
        db.run_write(
            lambda s: teams.update_quota(
                s, "nlp", teams.QuotaUpdate(submit_rate_per_s=0.05, submit_burst=1)
            )
        )
        with make_client(db, tmp_path, redis_url="redis://127.0.0.1:1/0") as client:
            assert submit(client, tokens["nlp"], "k1").status_code == 201
            assert submit(client, tokens["nlp"], "k2").status_code == 429


BAD_QUOTA = [
    pytest.param({"weight": 1e9}, "weight", id="weight above the maximum"),
    pytest.param({"weight": 0}, "weight", id="zero weight"),
    pytest.param({"weight": 5e-324}, "weight", id="subnormal weight"),
    pytest.param({"max_runtime_limit_s": 1e-300}, "max_runtime_limit_s", id="1e-300 s limit"),
    pytest.param({"guaranteed_gpus": {"H100": 10**7}}, "guaranteed_gpus", id="10M GPUs"),
    pytest.param({"guaranteed_gpus": {"H100": -1}}, "guaranteed_gpus", id="negative guarantee"),
    pytest.param({"guaranteed_gpus": {"H100": 1.5}}, "guaranteed_gpus", id="fractional GPUs"),
    pytest.param(
        {"guaranteed_gpus": {f"T{i}": 1 for i in range(65)}},
        "guaranteed_gpus",
        id="65 GPU types",
    ),
    pytest.param({"borrow_limit_gpus": -2}, "borrow_limit_gpus", id="borrow below -1"),
    pytest.param({"borrow_limit_gpus": 10**9}, "borrow_limit_gpus", id="borrow 1e9"),
    pytest.param({"lending_limit_gpus": {"H100": -1}}, "lending_limit_gpus", id="negative lend"),
    pytest.param({"max_outstanding_jobs": -1}, "max_outstanding_jobs", id="negative outstanding"),
    pytest.param({"max_outstanding_jobs": 10**12}, "max_outstanding_jobs", id="1e12 outstanding"),
    pytest.param({"submit_rate_per_s": -1}, "submit_rate_per_s", id="negative rate"),
    pytest.param({"submit_rate_per_s": 1e12}, "submit_rate_per_s", id="1e12 rate"),
    pytest.param({"submit_burst": 0}, "submit_burst", id="zero burst"),
    pytest.param({"submit_burst": "10"}, "submit_burst", id="burst as a string"),
]


class TestQuotaBounds:
    @pytest.mark.parametrize(("body", "want_field"), BAD_QUOTA)
    def test_rest_refuses_with_422_naming_the_field(self, db, tokens, tmp_path, body, want_field):
        with make_client(db, tmp_path) as client:
            r = put_team(client, tokens["admin"], "nlp", body)
            assert r.status_code == 422, r.text
            assert r.json()["field"].split(".")[0] == want_field, r.json()

    @pytest.mark.parametrize("raw", ['{"weight": Infinity}', '{"submit_rate_per_s": NaN}'])
    def test_non_finite_numbers_are_422(self, db, tokens, tmp_path, raw) -> None:
        with make_client(db, tmp_path) as client:
            r = client.put(
                "/v1/admin/teams/nlp",
                content=raw,
                headers={
                    "Authorization": f"Bearer {tokens['admin']}",
                    "Content-Type": "application/json",
                },
            )
            assert r.status_code == 422, r.text

    @pytest.mark.parametrize(
        ("upd", "want_field"),
        [
            (teams.QuotaUpdate(weight=float("inf")), "weight"),
            (teams.QuotaUpdate(weight=float("nan")), "weight"),
            (teams.QuotaUpdate(weight=1e-7), "weight"),
            (teams.QuotaUpdate(max_runtime_limit_s=1e-300), "max_runtime_limit_s"),
            (teams.QuotaUpdate(default_max_runtime_s=0.5), "default_max_runtime_s"),
            (teams.QuotaUpdate(guaranteed_gpus={"H100": 10**7}), "guaranteed_gpus"),
            (teams.QuotaUpdate(borrow_limit_gpus=10**9), "borrow_limit_gpus"),
            (teams.QuotaUpdate(submit_rate_per_s=float("inf")), "submit_rate_per_s"),
            (teams.QuotaUpdate(submit_burst=0), "submit_burst"),
            (teams.QuotaUpdate(max_outstanding_jobs=-5), "max_outstanding_jobs"),
        ],
    )
    def test_the_service_checks_too(self, db, tokens, upd, want_field) -> None:
        with pytest.raises(ValidationFailed) as err:
            db.run_write(lambda s: teams.update_quota(s, "nlp", upd))
        assert err.value.field == want_field


@pytest.mark.slow
def test_admin_team_set_and_list_through_the_cli(tmp_path: Path) -> None:
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

    assert cli("team", "create", "nlp").returncode == 0
    done = cli(
        "team",
        "set",
        "nlp",
        "--max-outstanding",
        "7",
        "--submit-rate",
        "5/s",
        "--submit-burst",
        "9",
        "--read-rate",
        "20/s",
        "--read-burst",
        "40",
    )
    assert done.returncode == 0, done.stderr
    listed = {t["team"]: t for t in json.loads(cli("team", "list", "-o", "json").stdout)}
    got = listed["nlp"]
    assert (got["max_outstanding_jobs"], got["submit_rate_per_s"], got["submit_burst"]) == (
        7,
        5.0,
        9,
    )
    assert (got["read_rate_per_s"], got["read_burst"]) == (20.0, 40)
    assert listed["ops"]["read_rate_per_s"] == Settings().team_read_rate_per_s  # the default
    bad = cli("team", "set", "nlp", "--read-rate", "nan")
    assert bad.returncode == 2 and "--read-rate" in bad.stderr
    bad = cli("team", "set", "nlp", "--submit-rate", "1e12/s")
    assert bad.returncode == 2 and "submit_rate_per_s" in bad.stderr
    assert "Traceback" not in bad.stderr
    table = cli("team", "list")
    assert table.returncode == 0 and "nlp" in table.stdout
    server.stop()


class TestOutstandingCount:
    """Counting a team's unfinished jobs is skipped while a recent count is far from the
    limit, and exact near it (the limit still holds to the job)."""

    def test_counts_only_near_the_limit(self, db, tokens, monkeypatch) -> None:
        from sqlalchemy import event

        from gpufleet.services import job_admission
        from tests.factories import submit as submit_direct

        # no timing in the test
        monkeypatch.setattr(job_admission, "OUTSTANDING_COUNT_TTL_S", 3600.0)
        counts: list[str] = []

        def seen(_conn, _cur, statement, *_args) -> None:  # type: ignore[no-untyped-def]
            if "count(*)" in statement.lower() and "jobs" in statement.lower():
                counts.append(statement)

        event.listen(db.engine, "before_cursor_execute", seen)
        try:
            db.run_write(
                lambda s: teams.update_quota(s, "nlp", teams.QuotaUpdate(max_outstanding_jobs=20))
            )
            for _ in range(10):  # far from 20: one exact count, then the estimate
                submit_direct(db, team="nlp")
            assert len(counts) == 1
            for _ in range(10):  # from 18 of 20 on (90 %): exact every time
                submit_direct(db, team="nlp")
            with pytest.raises(LimitExceeded):  # the 21st: the limit holds to the job
                submit_direct(db, team="nlp")
            assert len(counts) >= 5
        finally:
            event.remove(db.engine, "before_cursor_execute", seen)


class TestPriorityClasses:
    def test_the_api_refuses_or_demotes_a_class_as_the_teams_limits_say_at_once(
        self, db, tokens, tmp_path
    ) -> None:
        """Submits read the class rules from the API's cached team limits: a change made
        through the admin API applies to the next submit (the cache is dropped)."""
        headers = {"Authorization": f"Bearer {tokens['nlp']}"}

        def post(key: str) -> Any:
            return client.post(
                "/v1/jobs",
                json={**JOB, "priority": "CRITICAL"},
                headers={**headers, "Idempotency-Key": key},
            )

        with make_client(db, tmp_path) as client:
            assert post("before").status_code == 201  # cached with no limits
            rules = {"allowed_classes": ["NORMAL", "LOW"], "disallowed": "refuse"}
            assert put_team(client, tokens["admin"], "nlp", {"limits": rules}).status_code == 200
            r = post("refused")
            assert r.status_code == 422 and r.json()["field"] == "priority", r.text
            rules["disallowed"] = "demote"
            assert put_team(client, tokens["admin"], "nlp", {"limits": rules}).status_code == 200
            r = post("demoted")
            assert r.status_code == 201, r.text
            assert r.json()["warnings"] == [
                "CRITICAL is not allowed for team nlp: the job runs at NORMAL"
            ], r.text
            job = client.get(f"/v1/jobs/{r.json()['job_id']}", headers=headers).json()
            assert job["priority"] == "NORMAL"
            replay = post("demoted")  # a replay is not warned again
            assert replay.status_code == 200 and replay.json()["warnings"] is None
