"""Another team's job ids are not shown to a team token (services.redact), over REST with two
teams, on both databases: wait reasons and start estimates of GET /v1/jobs/{id} and
GET /v1/jobs, and the job's events; an admin token sees the ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpufleet.api.app import AppState, create_app
from gpufleet.objectstore import ObjectStore
from gpufleet.policy.start_estimate import _why_unbounded
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.services.redact import redact_text
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow
from gpufleet.store.transitions import record_event
from tests.factories import create_node


@pytest.fixture
def api(db: Database, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    app = create_app(
        AppState(Settings(data_dir=tmp_path), db, InProcWaker(), ObjectStore(str(tmp_path / "o")))
    )
    tokens = {
        t: db.run_write(lambda s, t=t: (auth.create_team(s, t), auth.create_token(s, t))[1])
        for t in ("vision", "default2")
    }
    tokens["admin"] = db.run_write(lambda s: auth.create_token(s, "vision", is_admin=True))
    create_node(db, "n1", gpus=8)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokens


def _h(token: str, key: str = "k") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Idempotency-Key": key}


def _submit(client: TestClient, token: str, key: str) -> str:
    r = client.post("/v1/jobs", json={"command": ["true"], "gpu_count": 8}, headers=_h(token, key))
    assert r.status_code == 201, r.text
    return str(r.json()["job_id"])


def test_other_teams_job_ids_are_replaced_for_a_team_token(api, db: Database) -> None:
    client, tokens = api
    theirs = _submit(client, tokens["default2"], "theirs")
    mine_too = _submit(client, tokens["vision"], "mine-too")
    mine = _submit(client, tokens["vision"], "mine")
    unknown = _why_unbounded(theirs, True)  # the leader's own words for a running blocker

    def as_leader(s) -> None:
        row = s.get(JobRow, mine)
        row.pending_reason = {
            "code": "no_node_fits_now",
            "message": f"The free GPUs on n1 are held for job {theirs}, then job {mine_too}.",
            "details": {"held_for_job": theirs, "jobs": [theirs, mine_too]},
            "start_estimate": {"unknown": unknown},
        }
        record_event(s, "note", message=f"preempted for job {theirs}", job_id=mine)

    db.run_write(as_leader)
    got = client.get(f"/v1/jobs/{mine}", headers=_h(tokens["vision"])).json()
    text = repr(got["pending_reason"])
    assert theirs not in text, text
    assert mine_too in text  # its own team's jobs stay named
    reason = got["pending_reason"]
    assert "held for a job of another team, then job " + mine_too in reason["message"]
    assert reason["details"]["held_for_job"] == "a job of another team"
    assert (
        "held by a running job of another team with no max_runtime_s"
        in (reason["start_estimate"]["text"])
    )
    listed = client.get("/v1/jobs?status=PENDING", headers=_h(tokens["vision"])).json()
    assert theirs not in repr([j["pending_reason"] for j in listed["items"]])
    events = client.get(f"/v1/jobs/{mine}/events", headers=_h(tokens["vision"])).json()
    assert theirs not in repr(events) and "a job of another team" in repr(events)
    patched = client.patch(f"/v1/jobs/{mine}", json={"name": "n2"}, headers=_h(tokens["vision"]))
    assert patched.status_code == 200, patched.text
    assert theirs not in patched.text and "of another team" in patched.text
    # the other team's token cannot see the job at all; an admin sees every id
    assert client.get(f"/v1/jobs/{theirs}", headers=_h(tokens["vision"])).status_code == 404
    admin = client.get(f"/v1/jobs/{mine}", headers=_h(tokens["admin"])).json()
    assert theirs in admin["pending_reason"]["message"]
    assert theirs in admin["pending_reason"]["start_estimate"]["text"]


def test_redact_text_phrases() -> None:
    a, b = "j-" + "0" * 26, "j-" + "1" * 26
    foreign = {a}
    assert (
        redact_text(f"nothing starts it before the reserved 8-GPU job {a} (in 5 min)", foreign)
        == "nothing starts it before a reserved 8-GPU job of another team (in 5 min)"
    )
    assert redact_text(f"held by job(s) {a}, {b} on a silent node", foreign) == (
        f"held by a job of another team, {b} on a silent node"
    )
    assert redact_text(f"held by running job {b}", foreign) == f"held by running job {b}"


def test_suggestions_name_no_job_of_another_team(api, db: Database, monkeypatch) -> None:
    """The what-if passes read the whole fleet; their sentence (``policy.suggest``'s own
    wording for a reservation ahead) reaches vision's token without the other team's id."""
    from gpufleet.services import suggest as suggest_service

    client, tokens = api
    theirs = _submit(client, tokens["default2"], "theirs")
    mine = _submit(client, tokens["vision"], "mine")
    real = suggest_service.job_suggestions

    def ahead(db_, team, job_id, **kw):
        answer = real(db_, team, job_id, **kw)  # the job's own answer, then the sentence
        answer["none_reason"] = (
            f"nothing starts it before the reserved 8-GPU job {theirs} (in 1h on n1; "
            f"tried 4-1 GPUs)"
        )
        return answer

    monkeypatch.setattr(suggest_service, "job_suggestions", ahead)
    seen = client.get(f"/v1/jobs/{mine}/suggestions", headers=_h(tokens["vision"]))
    assert seen.status_code == 200, seen.text
    assert theirs not in seen.text
    assert seen.json()["none_reason"].startswith(
        "nothing starts it before a reserved 8-GPU job of another team (in 1h"
    )
    admin = client.get(f"/v1/jobs/{mine}/suggestions", headers=_h(tokens["admin"])).json()
    assert theirs in admin["none_reason"]
