"""The /ui pages over a real database (SQLite and PostgreSQL): the GPU grid's cell states,
team scoping, login, escaping, usage. The browser tests (tests/e2e) cover the live updates."""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from gpufleet.api.app import AppState, create_app
from gpufleet.domain.states import NodeStatus
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import InProcWaker
from gpufleet.services import auth, nodes, runs
from gpufleet.services.jobs import submit_job
from gpufleet.settings import Settings
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.tables import GpuHoldRow, JobRunRow
from tests.factories import become_leader, create_node, make_spec, submit
from tests.store.test_runs import write_manifest


def place(db: Database, job_id: str, node_id: str, gpus: int, epoch: int) -> allocate.Reserved:
    return db.run_write(
        lambda s: allocate.reserve(
            s,
            job_id=job_id,
            node_id=node_id,
            gpu_count=gpus,
            seen_fencing_epoch=0,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
        )
    )


@pytest.fixture
def ui(
    db: Database, tmp_path: Path
) -> Iterator[tuple[TestClient, dict[str, str], dict[str, str]]]:
    app = create_app(
        AppState(Settings(data_dir=tmp_path), db, InProcWaker(), ObjectStore(str(tmp_path / "o")))
    )
    tokens = {
        team: db.run_write(lambda s, t=team: auth.create_token(s, t, create_team_if_missing=True))
        for team in ("vision", "nlp")
    }
    tokens["admin"] = db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    for node_id, gpus in (("n1", 4), ("n2", 4), ("n3", 2)):
        create_node(db, node_id, gpus=gpus)
    epoch = become_leader(db)
    ids: dict[str, str] = {}
    # n1: vision runs on 2 GPUs, 1 GPU is held for a preemptor, 1 is free
    ids["vision"] = submit(db, "vision", gpus=2).job_id
    r = place(db, ids["vision"], "n1", 2, epoch)
    db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
    ids["held_for"] = submit(db, "nlp", gpus=1).job_id
    db.run_write(
        lambda s: s.add(
            GpuHoldRow(
                job_id=ids["held_for"],
                node_id="n1",
                gpu_count=1,
                reason="priority",
                since=datetime.now(UTC),
            )
        )
    )
    # n2: an nlp attempt fenced with its node: 2 GPUs quarantined, the node unschedulable
    ids["fenced"] = submit(db, "nlp", gpus=2).job_id
    place(db, ids["fenced"], "n2", 2, epoch)
    db.run_write(
        lambda s: nodes.fence_node(
            s, "n2", reason="test", max_node_failures=3, node_to=NodeStatus.QUARANTINED
        )
    )
    # n3: cordoned by an operator
    db.run_write(lambda s: nodes.set_node_status(s, "n3", NodeStatus.CORDONED, message="test"))
    ids["waiting"] = submit(db, "vision", gpus=4).job_id  # waits: no node has 4 free
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokens, ids


def form_csrf(html: str) -> str:
    """The csrf token of the first form of a page (as a browser would post it)."""
    found = re.search(r'name="csrf" value="([^"]*)"', html)
    assert found, "no csrf field in the page"
    return found.group(1)


def login(client: TestClient, token: str) -> None:
    csrf = form_csrf(client.get("/ui/login").text)
    r = client.post("/ui/login", data={"token": token, "csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/"


def logout(client: TestClient) -> None:
    csrf = form_csrf(client.get("/ui/queue").text)
    r = client.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303


def cells(html: str, node_id: str) -> Counter[str]:
    card = html.split(f'id="node-{node_id}"', 1)[1].split('class="node"', 1)[0]
    return Counter(re.findall(r'data-state="([a-z]+)"', card))


def test_grid_shows_running_held_quarantined_and_unavailable_gpus(
    ui: tuple[TestClient, dict[str, str], dict[str, str]],
) -> None:
    client, tokens, ids = ui
    login(client, tokens["admin"])
    html = client.get("/ui/fleet").text
    assert cells(html, "n1") == {"running": 2, "held": 1, "free": 1}
    assert cells(html, "n2") == {"quarantined": 2, "cordoned": 2}
    assert cells(html, "n3") == {"cordoned": 2}
    assert f'href="/ui/jobs/{ids["vision"]}"' in html
    # the live region alone, as htmx asks for it
    live = client.get("/ui/fleet", headers={"HX-Request": "true"}).text
    assert "<html" not in live and cells(live, "n1")["running"] == 2


def test_a_team_sees_its_own_jobs_only(
    ui: tuple[TestClient, dict[str, str], dict[str, str]],
) -> None:
    client, tokens, ids = ui
    login(client, tokens["nlp"])
    assert client.get("/ui/", follow_redirects=False).headers["location"] == "/ui/queue"
    grid = client.get("/ui/fleet").text
    assert cells(grid, "n1")["running"] == 2
    assert "vision" not in grid.split('id="live"', 1)[1]  # other teams' GPUs: "in use"
    assert client.get(f"/ui/jobs/{ids['vision']}").status_code == 404
    assert client.get(f"/ui/jobs/{ids['vision']}/log").status_code == 404
    csrf = form_csrf(client.get("/ui/queue").text)
    assert client.post(f"/ui/jobs/{ids['vision']}/cancel", data={"csrf": csrf}).status_code == 404
    assert client.get(f"/ui/jobs/{ids['fenced']}").status_code == 200
    queue = client.get("/ui/queue").text
    assert ids["waiting"] not in queue and ids["held_for"] in queue


def test_login_refuses_a_bad_token_and_pages_need_one(
    ui: tuple[TestClient, dict[str, str], dict[str, str]],
) -> None:
    client, tokens, _ = ui
    for path in ("/ui/fleet", "/ui/queue", "/ui/usage", "/ui/jobs/j-x"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login", path
    csrf = form_csrf(client.get("/ui/login").text)
    r = client.post("/ui/login", data={"token": "gft_nope", "csrf": csrf}, follow_redirects=False)
    assert r.headers["location"] == "/ui/login?error=invalid"
    assert "not valid" in client.get("/ui/login?error=invalid").text
    login(client, tokens["vision"])
    cookie = next(c for c in client.cookies.jar if c.name == "gpufleet_token")
    assert cookie.path == "/ui" and cookie.has_nonstandard_attr("HttpOnly")
    assert client.get("/ui/queue").status_code == 200
    logout(client)
    assert client.get("/ui/queue", follow_redirects=False).status_code == 303


def finish_backdated(
    db: Database,
    store: ObjectStore,
    team: str,
    node_id: str,
    ago: timedelta,
    code: int,
    more: tuple[str, ...] = (),
) -> str:
    """A 1-GPU attempt on ``node_id`` reserved ``ago`` before now and ended now (exit
    ``code``), through ``complete_run``: its usage record spans ``ago``."""
    job_id = submit(db, team, gpus=1).job_id
    r = place(db, job_id, node_id, 1, become_leader(db))

    def backdate(s: Any) -> None:
        s.execute(
            update(JobRunRow)
            .where(JobRunRow.id == r.run_id)
            .values(created_at=s.get(JobRunRow, r.run_id).created_at - ago)
        )
        assert runs.confirm_assignment(s, r.run_id, r.token) == runs.Confirm.CONFIRMED

    db.run_write(backdate)
    uri = write_manifest(store, job_id, r.run_id, r.token, exit_code=code, more=more)
    rep = runs.Report(node_id, r.run_id, r.token, runs.Outcome.EXITED, code, uri)
    assert runs.complete_run(db, store, rep)[0] == runs.CompletionResult.ACCEPTED
    return job_id


def page_hours(html: str) -> tuple[str, dict[str, float]]:
    table = html.split('id="usage"', 1)[1].split("</table>", 1)[0]
    since = re.search(r'data-since="([^"]+)"', table)
    assert since is not None
    rows = re.findall(r'data-team="([^"]+)" data-gpu-hours="([0-9.]+)"', table)
    return since.group(1), {team: float(h) for team, h in rows}


def test_usage_page_sums_the_accounting_records_like_the_usage_api(
    ui: tuple[TestClient, dict[str, str], dict[str, str]], db: Database, tmp_path: Path
) -> None:
    client, tokens, _ = ui
    store = ObjectStore(str(tmp_path / "o"))
    # n1's free GPU: vision 30 h (inside the window), then nlp 20 days (clipped to it)
    finish_backdated(db, store, "vision", "n1", timedelta(hours=30), 0)
    finish_backdated(db, store, "nlp", "n1", timedelta(days=20), 3)
    login(client, tokens["admin"])
    since, hours = page_hours(client.get("/ui/usage").text)
    admin = {"Authorization": f"Bearer {tokens['admin']}"}
    api = client.get("/v1/usage", params={"since": since, "by": "team"}, headers=admin).json()
    want = {ln["key"]: ln["gpu_hours"] for ln in api["items"]}
    assert hours.keys() == want.keys() >= {"vision", "nlp"}
    for team, h in want.items():
        assert abs(hours[team] - h) < 2e-6, (team, hours[team], h)
    # the running vision attempt (2 GPUs) counts only once it ends, as in GET /v1/usage
    assert 30 - 0.05 < hours["vision"] < 30 + 0.05
    assert 13 * 24 < hours["nlp"] < 14 * 24  # clipped to the 14 UTC days shown
    # a team token: its own team, the same figure as its GET /v1/usage
    logout(client)
    login(client, tokens["vision"])
    _, mine = page_hours(client.get("/ui/usage").text)
    own = client.get(
        "/v1/usage",
        params={"since": since},
        headers={"Authorization": f"Bearer {tokens['vision']}"},
    ).json()
    assert mine.keys() == {"vision"}
    assert abs(mine["vision"] - own["items"][0]["gpu_hours"]) < 2e-6


def test_cancel_from_the_page(ui: tuple[TestClient, dict[str, str], dict[str, str]]) -> None:
    client, tokens, ids = ui
    login(client, tokens["vision"])
    page = client.get(f"/ui/jobs/{ids['waiting']}").text
    assert 'id="cancel"' in page and "PENDING" in page
    confirm = client.get(f"/ui/jobs/{ids['waiting']}/cancel").text  # the link's page
    r = client.post(
        f"/ui/jobs/{ids['waiting']}/cancel",
        data={"csrf": form_csrf(confirm), "confirm": "yes"},
        follow_redirects=False,
    )
    assert r.status_code == 303
    page = client.get(f"/ui/jobs/{ids['waiting']}").text
    assert 'id="job-status">CANCELLED<' in page and 'id="cancel"' not in page


def test_a_job_page_by_name_or_id_prefix_redirects_to_its_id(
    ui: tuple[TestClient, dict[str, str], dict[str, str]], db: Database
) -> None:
    client, tokens, _ = ui
    login(client, tokens["vision"])
    spec = dataclasses.replace(make_spec(), name="trial-page")
    named = submit_job(db, team_id="vision", idempotency_key=str(uuid.uuid4()), spec=spec).job_id
    for ref in ("trial-page", named[:-1], named.removeprefix("j-")[:-1]):
        r = client.get(f"/ui/jobs/{ref}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == f"/ui/jobs/{named}", ref
        assert client.get(f"/ui/jobs/{ref}/log").status_code == 200
    assert client.get("/ui/jobs/trial-page").status_code == 200  # followed to the page
    assert client.get("/ui/jobs/no-such-name").status_code == 404
    # another team's job is not found by name either
    login(client, tokens["nlp"])
    assert client.get("/ui/jobs/trial-page").status_code == 404


def test_job_page_shows_env_names_but_never_values(
    ui: tuple[TestClient, dict[str, str], dict[str, str]], db: Database
) -> None:
    import uuid

    from gpufleet.domain.types import JobSpec, Resources
    from gpufleet.services.jobs import submit_job

    client, tokens, _ = ui
    spec = JobSpec(
        command=("true",),
        resources=Resources(1),
        env={"API_SECRET": "s3cr3t-value", "PATH": "/opt/private/bin:/usr/bin"},
    )
    job_id = submit_job(db, team_id="vision", idempotency_key=str(uuid.uuid4()), spec=spec).job_id
    login(client, tokens["vision"])
    for path in (f"/ui/jobs/{job_id}", "/ui/queue", "/ui/fleet"):
        html = client.get(path).text
        assert "s3cr3t-value" not in html and "/opt/private/bin" not in html, path
    page = client.get(f"/ui/jobs/{job_id}").text
    assert "API_SECRET" in page and "env_keys" in page


def test_login_cookie_is_secure_over_https_and_logout_deletes_it_alike(
    ui: tuple[TestClient, dict[str, str], dict[str, str]],
) -> None:
    client, tokens, _ = ui
    csrf = form_csrf(client.get("/ui/login").text)
    plain = client.post(
        "/ui/login", data={"token": tokens["vision"], "csrf": csrf}, follow_redirects=False
    )
    assert "secure" not in plain.headers["set-cookie"].lower()
    https = TestClient(client.app, base_url="https://testserver")
    csrf = form_csrf(https.get("/ui/login").text)
    r = https.post(
        "/ui/login", data={"token": tokens["vision"], "csrf": csrf}, follow_redirects=False
    )
    set_cookie = r.headers["set-cookie"].lower()
    assert "secure" in set_cookie and "samesite=strict" in set_cookie and "httponly" in set_cookie
    csrf = form_csrf(https.get("/ui/queue").text)
    out = https.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
    out = out.headers["set-cookie"].lower()
    assert "gpufleet_token=" in out and "max-age=0" in out
    for attr in ("secure", "samesite=strict", "httponly", "path=/ui"):
        assert attr in out, attr


def test_queue_and_job_pages_mark_held_jobs(
    ui: tuple[TestClient, dict[str, str], dict[str, str]], db: Database
) -> None:
    from gpufleet.services import jobctl

    client, tokens, ids = ui
    db.run_write(lambda s: jobctl.hold_job(s, "vision", ids["waiting"]))
    login(client, tokens["vision"])
    queue = client.get("/ui/queue").text
    row = queue.split(f'data-job="{ids["waiting"]}"', 1)[1].split("</tr>", 1)[0]
    assert "PENDING (held)" in row
    page = client.get(f"/ui/jobs/{ids['waiting']}").text
    assert "PENDING (held)" in page


def test_usage_of_an_unknown_team_is_404_naming_team(
    ui: tuple[TestClient, dict[str, str], dict[str, str]],
) -> None:
    client, tokens, _ = ui
    admin = {"Authorization": f"Bearer {tokens['admin']}"}
    r = client.get("/v1/usage", params={"team": "nosuch"}, headers=admin)
    assert r.status_code == 404 and r.json()["field"] == "team"
    assert client.get("/v1/usage", params={"team": "vision"}, headers=admin).status_code == 200
