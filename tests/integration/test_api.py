"""REST API v1 over ASGI on both databases: auth, validation (4xx naming the field, never 500),
idempotent submit (also under concurrent retries), team isolation, pagination, cancel."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpufleet.api.app import AppState, create_app
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from tests.factories import create_node


@pytest.fixture
def api(db: Database, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    settings = Settings(data_dir=tmp_path)
    app = create_app(AppState(settings, db, InProcWaker(), ObjectStore(str(tmp_path / "objects"))))
    tokens = {}
    for team in ("vision", "nlp"):
        tokens[team] = db.run_write(
            lambda s, t=team: (auth.create_team(s, t), auth.create_token(s, t))[1]
        )
    create_node(db, "n1", gpus=8)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokens


def hdr(token: str, key: str | None = "k1") -> dict[str, str]:
    h = {"Authorization": f"Bearer {token}"}
    if key is not None:
        h["Idempotency-Key"] = key
    return h


JOB = {"command": ["python3", "train.py"], "gpu_count": 2}


class TestSubmit:
    def test_creates_a_pending_job(self, api) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"]))
        assert r.status_code == 201
        body = r.json()
        assert body["status"] == "PENDING" and body["job_id"].startswith("j-")
        got = client.get(f"/v1/jobs/{body['job_id']}", headers=hdr(tokens["vision"])).json()
        assert got["team"] == "vision" and got["gpu_count"] == 2 and got["attempts"] == []
        assert got["pending_reason"]["code"]

    def test_same_key_same_payload_returns_the_same_job(self, api) -> None:
        client, tokens = api
        a = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], "same"))
        b = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], "same"))
        assert (a.status_code, b.status_code) == (201, 200)
        assert a.json()["job_id"] == b.json()["job_id"]

    def test_same_key_other_payload_is_409(self, api) -> None:
        client, tokens = api
        client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], "k"))
        r = client.post(
            "/v1/jobs", json={**JOB, "gpu_count": 4}, headers=hdr(tokens["vision"], "k")
        )
        assert r.status_code == 409
        assert r.json()["error"] == "idempotency_key_reused_with_different_payload"

    def test_keys_are_scoped_to_the_team(self, api) -> None:
        client, tokens = api
        a = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], "k")).json()
        b = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["nlp"], "k")).json()
        assert a["job_id"] != b["job_id"]

    def test_concurrent_retries_create_one_job(self, api) -> None:
        client, tokens = api
        ids: list[str] = []
        codes: list[int] = []
        barrier = threading.Barrier(8)

        def go() -> None:
            barrier.wait()
            r = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], "race"))
            codes.append(r.status_code)
            ids.append(r.json().get("job_id"))

        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(ids)) == 1 and None not in ids
        assert sorted(codes).count(201) == 1 and all(c in (200, 201) for c in codes)
        listed = client.get("/v1/jobs", headers=hdr(tokens["vision"])).json()["items"]
        assert len(listed) == 1


BAD = [
    pytest.param({**JOB, "gpu_count": 0}, "gpu_count", id="zero GPUs"),
    pytest.param({**JOB, "gpu_count": -1}, "gpu_count", id="negative GPUs"),
    pytest.param({**JOB, "gpu_count": 9}, "gpu_count", id="more GPUs than any node holds"),
    pytest.param({**JOB, "gpu_count": "many"}, "gpu_count", id="GPUs not a number"),
    pytest.param({**JOB, "priority": "URGENT"}, "priority", id="unknown priority"),
    pytest.param({"gpu_count": 1}, "command", id="missing command"),
    pytest.param({**JOB, "command": []}, "command", id="empty command"),
    pytest.param({**JOB, "env": {"X": "y" * 1_000_000}}, "env", id="1 MB env"),
    pytest.param({**JOB, "gpu_type": "TPUv9"}, "gpu_type", id="GPU type no node has"),
    pytest.param({**JOB, "bogus": 1}, "bogus", id="unknown field"),
    pytest.param({**JOB, "max_retries": -2}, "max_retries", id="negative retries"),
    pytest.param({**JOB, "gpu_count": "2"}, "gpu_count", id="GPU count as a string"),
    pytest.param({**JOB, "gpu_count": True}, "gpu_count", id="GPU count as a boolean"),
    pytest.param({**JOB, "command": ["echo", "a\x00b"]}, "command", id="NUL in the command"),
    pytest.param({**JOB, "name": "a\x00b"}, "name", id="NUL in the name"),
    pytest.param({**JOB, "name": "bad name\n"}, "name", id="newline in the name"),
    pytest.param({**JOB, "name": "x\x1b[31m"}, "name", id="escape sequence in the name"),
    pytest.param({**JOB, "max_runtime_s": 1e300}, "max_runtime_s", id="max_runtime_s 1e300"),
    pytest.param(
        {**JOB, "expected_duration_s": 1e12}, "expected_duration_s", id="expected 31,000 years"
    ),
    pytest.param({**JOB, "env": {"K": "v\x00"}}, "env", id="NUL in env"),
    pytest.param({**JOB, "cpu": 4096}, "cpu", id="more CPUs than any node"),
    pytest.param(
        {**JOB, "node_selector": {"zone": "mars"}}, "node_selector", id="labels no node has"
    ),
    pytest.param({**JOB, "working_dir": "relative/dir"}, "working_dir", id="relative working_dir"),
]


class TestValidation:
    @pytest.mark.parametrize(("body", "want_field"), BAD)
    def test_bad_input_is_4xx_naming_the_field(self, api, body, want_field) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json=body, headers=hdr(tokens["vision"]))
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["field"] == want_field, r.json()
        assert want_field in r.json()["message"] or r.json()["field"] == want_field

    def test_malformed_json_is_400(self, api) -> None:
        client, tokens = api
        r = client.post(
            "/v1/jobs",
            content=b'{"command": [',
            headers={**hdr(tokens["vision"]), "Content-Type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"] == "malformed_json"

    def test_huge_body_is_413(self, api) -> None:
        client, tokens = api
        body = json.dumps({**JOB, "env": {"X": "y" * 3_000_000}})
        r = client.post(
            "/v1/jobs",
            content=body,
            headers={**hdr(tokens["vision"]), "Content-Type": "application/json"},
        )
        assert r.status_code == 413 and r.json()["field"] == "body"

    def test_missing_idempotency_key_is_422(self, api) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], key=None))
        assert r.status_code == 422 and r.json()["field"] == "Idempotency-Key"

    @pytest.mark.parametrize("authz", [None, "Bearer nope", "Basic abc"])
    def test_bad_token_is_401(self, api, authz) -> None:
        client, _ = api
        headers = {"Idempotency-Key": "k"} | ({"Authorization": authz} if authz else {})
        assert client.post("/v1/jobs", json=JOB, headers=headers).status_code == 401

    def test_unknown_list_status_is_422(self, api) -> None:
        client, tokens = api
        r = client.get("/v1/jobs?status=NOPE", headers=hdr(tokens["vision"]))
        assert r.status_code == 422 and r.json()["field"] == "status"
        r = client.get("/v1/jobs?status=PENDING,NOPE", headers=hdr(tokens["vision"]))
        assert r.status_code == 422 and "'NOPE'" in r.json()["message"]

    def test_list_by_several_statuses(self, api) -> None:
        """``status`` takes a comma list: jobs in any of those states."""
        client, tokens = api
        h = hdr(tokens["vision"])
        job = client.post("/v1/jobs", json=JOB, headers=h).json()["job_id"]
        done = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], key="k2"))
        done = done.json()["job_id"]
        assert client.delete(f"/v1/jobs/{done}", headers=h).status_code == 202

        def listed(status: str) -> set[str]:
            r = client.get(f"/v1/jobs?status={status}", headers=h)
            assert r.status_code == 200, r.text
            return {j["job_id"] for j in r.json()["items"]}

        assert listed("PENDING") == {job}
        assert listed("PENDING,CANCELLED") == {job, done}
        assert listed("RUNNING,FAILED") == set()


class TestReads:
    def test_another_teams_job_is_404(self, api) -> None:
        client, tokens = api
        job = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"])).json()
        for path in (f"/v1/jobs/{job['job_id']}", f"/v1/jobs/{job['job_id']}/logs"):
            assert client.get(path, headers=hdr(tokens["nlp"])).status_code == 404
        assert (
            client.delete(f"/v1/jobs/{job['job_id']}", headers=hdr(tokens["nlp"])).status_code
            == 404
        )

    def test_list_paginates_with_a_cursor(self, api) -> None:
        client, tokens = api
        made = [
            client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], f"k{i}")).json()[
                "job_id"
            ]
            for i in range(5)
        ]
        seen, cursor = [], None
        while True:
            q = "/v1/jobs?limit=2" + (f"&cursor={cursor}" if cursor else "")
            page = client.get(q, headers=hdr(tokens["vision"])).json()
            seen += [j["job_id"] for j in page["items"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert seen == list(reversed(made))

    def test_cancel_pending_job_is_immediate(self, api) -> None:
        client, tokens = api
        job = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"])).json()
        r = client.delete(f"/v1/jobs/{job['job_id']}", headers=hdr(tokens["vision"]))
        assert r.status_code == 202 and r.json()["status"] == "CANCELLED"
        got = client.get(f"/v1/jobs/{job['job_id']}", headers=hdr(tokens["vision"])).json()
        assert got["status"] == "CANCELLED" and got["cancel_requested"] is True

    @pytest.mark.parametrize("job_id", ["j-%00", "..%2F..%2Fetc", "j-" + "z" * 300])
    def test_odd_ids_are_404_not_500(self, api, job_id) -> None:
        client, tokens = api
        assert client.get(f"/v1/jobs/{job_id}", headers=hdr(tokens["vision"])).status_code == 404

    @pytest.mark.parametrize("cursor", ["garbage", "%00"])
    def test_a_bad_cursor_is_422(self, api, cursor) -> None:
        client, tokens = api
        r = client.get(f"/v1/jobs?cursor={cursor}", headers=hdr(tokens["vision"]))
        assert r.status_code == 422 and r.json()["field"] == "cursor"

    def test_cancelling_twice_is_fine_but_a_finished_job_is_409(self, api, db) -> None:
        client, tokens = api
        job = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"])).json()["job_id"]
        for _ in range(2):
            assert (
                client.delete(f"/v1/jobs/{job}", headers=hdr(tokens["vision"])).status_code == 202
            )
        from sqlalchemy import update

        from gpufleet.store.tables import JobRow

        done = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"], "k2")).json()[
            "job_id"
        ]
        db.run_write(
            lambda s: s.execute(update(JobRow).where(JobRow.id == done).values(status="SUCCEEDED"))
        )
        r = client.delete(f"/v1/jobs/{done}", headers=hdr(tokens["vision"]))
        assert r.status_code == 409 and r.json()["error"] == "job_already_finished"

    def test_logs_of_a_job_without_attempt_are_empty(self, api) -> None:
        client, tokens = api
        job = client.post("/v1/jobs", json=JOB, headers=hdr(tokens["vision"])).json()["job_id"]
        r = client.get(f"/v1/jobs/{job}/logs", headers=hdr(tokens["vision"]))
        assert (r.status_code, r.text) == (200, "")

    def test_nodes_lists_capacity(self, api) -> None:
        client, tokens = api
        items = client.get("/v1/nodes", headers=hdr(tokens["vision"])).json()["items"]
        assert [(n["node_id"], n["total_gpus"], n["available_gpus"]) for n in items] == [
            ("n1", 8, 8)
        ]
        assert (items[0]["reported_gpus"], items[0]["reported_gpu_type"]) == (None, None)

    def test_nodes_show_a_pending_change_of_gpus(self, api, db: Database) -> None:
        """An agent re-registered with other GPUs while some are reserved: the recorded GPUs
        stay, and what it reported is shown next to them."""
        from gpufleet.services.nodes import set_status_reason
        from gpufleet.store import allocate
        from gpufleet.store.dialect import db_now
        from tests.factories import become_leader, submit

        client, tokens = api
        job, epoch = submit(db, team="vision", gpus=2).job_id, become_leader(db)
        db.run_write(
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
        )
        create_node(db, "n1", gpus=4, gpu_type="A100")
        db.run_write(lambda s: set_status_reason(s, "n1", "what the reason says is for people"))
        (node,) = client.get("/v1/nodes", headers=hdr(tokens["vision"])).json()["items"]
        got = {k: node[k] for k in ("status", "gpu_type", "total_gpus")}
        assert got == {"status": "DRAINING", "gpu_type": "H100", "total_gpus": 8}
        assert (node["reported_gpus"], node["reported_gpu_type"]) == (4, "A100")


class TestAdminQuota:
    def test_admin_sets_a_quota_and_members_cannot(self, api, db: Database) -> None:
        client, tokens = api
        admin = db.run_write(lambda s: auth.create_token(s, "vision", is_admin=True))
        body = {"guaranteed_gpus": {"H100": 8}, "borrow_limit_gpus": 4, "weight": 2}
        r = client.put("/v1/admin/teams/nlp", json=body, headers=hdr(admin))
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["guaranteed_gpus"], got["borrow_limit_gpus"], got["weight"]) == (
            {"H100": 8},
            4,
            2,
        )
        assert (
            client.put("/v1/admin/teams/nlp", json=body, headers=hdr(tokens["nlp"])).status_code
            == 403
        )
        bad = client.put(
            "/v1/admin/teams/nlp", json={"lending_limit_gpus": {"H100": 9}}, headers=hdr(admin)
        )
        assert bad.status_code == 422 and bad.json()["field"] == "lending_limit_gpus"
        assert (
            client.put("/v1/admin/teams/ghost", json=body, headers=hdr(admin)).status_code == 404
        )

    def test_outstanding_job_limit_is_429(self, api, db: Database) -> None:
        client, tokens = api
        admin = db.run_write(lambda s: auth.create_token(s, "vision", is_admin=True))
        client.put("/v1/admin/teams/nlp", json={"max_outstanding_jobs": 2}, headers=hdr(admin))
        codes = [
            client.post("/v1/jobs", json=JOB, headers=hdr(tokens["nlp"], f"k{i}")).status_code
            for i in range(3)
        ]
        assert codes == [201, 201, 429]


class TestAdminNodes:
    """Node identity over REST: addresses for admins only, join tokens, revoke, forget."""

    def test_node_addresses_are_shown_to_admin_tokens_only(self, api, db: Database) -> None:
        client, tokens = api
        admin = db.run_write(lambda s: auth.create_token(s, "vision", is_admin=True))
        member = client.get("/v1/nodes", headers=hdr(tokens["vision"])).json()["items"]
        assert [n["address"] for n in member] == [None]
        full = client.get("/v1/nodes", headers=hdr(admin)).json()["items"]
        assert full[0]["address"]

    def test_join_token_revoke_forget_and_list(self, api, db: Database, tmp_path: Path) -> None:
        from gpufleet.rpc import tls

        client, tokens = api
        admin = hdr(db.run_write(lambda s: auth.create_token(s, "vision", is_admin=True)))
        body = {"node_id": "n1", "ttl_s": 60}
        # no fleet CA next to this server: 409 naming what is missing
        r = client.post("/v1/admin/nodes/join-tokens", json=body, headers=admin)
        assert (r.status_code, r.json()["field"]) == (409, "pki_dir")
        ca = tls.init_ca(tmp_path / "pki")
        r = client.post("/v1/admin/nodes/join-tokens", json=body, headers=admin)
        assert r.status_code == 201, r.text
        assert tls.parse_join_token(r.json()["token"])[0] == ca.fingerprint
        for bad, field in (({"ttl_s": 1}, "ttl_s"), ({"node_id": "a b"}, "node_id")):
            r = client.post("/v1/admin/nodes/join-tokens", json=bad, headers=admin)
            assert (r.status_code, r.json()["field"]) == (422, field)
        member = hdr(tokens["vision"])
        for method, path in (
            ("get", "/v1/admin/nodes"),
            ("post", "/v1/admin/nodes/join-tokens"),
            ("post", "/v1/admin/nodes/n1/revoke"),
            ("delete", "/v1/admin/nodes/n1"),
        ):
            assert getattr(client, method)(path, headers=member).status_code == 403, path
        assert client.post("/v1/admin/nodes/ghost/revoke", headers=admin).status_code == 404
        # n1 sent a heartbeat just now and is not revoked: forgotten only with force
        r = client.delete("/v1/admin/nodes/n1", headers=admin)
        assert (r.status_code, r.json()["field"]) == (409, "force")
        assert "looks alive" in r.json()["message"] and "force" in r.json()["message"]
        assert client.get("/v1/nodes", headers=member).json()["items"] != []
        r = client.post("/v1/admin/nodes/n1/revoke", headers=admin)
        assert r.json() == {"node_id": "n1", "revoked_certs": 0}
        [row] = client.get("/v1/admin/nodes", headers=admin).json()["items"]
        # revoked: no longer trusted, so FENCED; cut off, it needs no force to be forgotten
        assert (row["node_id"], row["status"], row["cert_serial"]) == ("n1", "FENCED", None)
        r = client.delete("/v1/admin/nodes/n1", headers=admin)
        assert r.status_code == 200 and r.json()["forgotten"] is True
        assert client.get("/v1/nodes", headers=member).json()["items"] == []
