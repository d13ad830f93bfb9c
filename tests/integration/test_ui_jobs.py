"""The dashboard's job list (/ui/jobs: search, filters, pages, time columns), and the job
page's artifact downloads, gang rank selector, confirmed cancel, budget warnings and
"what would start it now", over a real database through the ASGI test client."""

from __future__ import annotations

import dataclasses
import html
import re
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from gpufleet.domain.types import JobSpec, Resources
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.services import auth
from gpufleet.services.jobs import submit_job
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow, JobRunRow
from tests.factories import become_leader, create_node, make_spec
from tests.integration import test_ui_pages
from tests.integration.test_ui_pages import finish_backdated, form_csrf, login, place

ui = test_ui_pages.ui  # the fixture: three teams' jobs on three nodes

Ui = tuple[TestClient, dict[str, str], dict[str, str]]
XSS_NAME = "<script>alert(1)</script>"


def named(db: Database, team: str, name: str, owner: str | None = None, **kw: Any) -> str:
    spec = dataclasses.replace(make_spec(), name=name, **kw)
    return submit_job(
        db, team_id=team, idempotency_key=str(uuid.uuid4()), spec=spec, owner=owner
    ).job_id


def listed(page: str) -> list[str]:
    table = page.split('id="jobs"', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<tr data-job="([^"]+)"', table)


def test_job_list_filters_by_status_name_owner_and_team(ui: Ui, db: Database) -> None:
    client, tokens, ids = ui
    alice = db.run_write(lambda s: auth.create_token(s, "vision", user="alice"))
    a = named(db, "vision", "resnet-sweep", owner="alice")
    b = named(db, "vision", "ResNet-final", owner="alice")
    c = named(db, "nlp", "resnet-nlp", owner="bob")
    login(client, alice)
    ab = sorted([a, b], reverse=True)  # newest first (ids sort by time)
    page = client.get("/ui/jobs").text
    mine = listed(page)
    assert {a, b, ids["vision"], ids["waiting"]} <= set(mine) and c not in mine
    assert mine == sorted(mine, reverse=True)  # newest first
    assert listed(client.get("/ui/jobs", params={"q": "resnet"}).text) == ab
    assert listed(client.get("/ui/jobs", params={"q": "SWEEP"}).text) == [a]
    assert listed(client.get("/ui/jobs", params={"q": "%"}).text) == []  # no wildcard
    pending = listed(client.get("/ui/jobs", params={"status": "PENDING"}).text)
    assert ids["waiting"] in pending and ids["vision"] not in pending
    assert listed(client.get("/ui/jobs", params={"status": "SUCCEEDED"}).text) == []
    # a team token's team filter is ignored: still its own team only
    assert c not in listed(client.get("/ui/jobs", params={"team": "nlp"}).text)
    # mine: the token's user (alice); user: anyone's
    assert listed(client.get("/ui/jobs", params={"mine": "1"}).text) == ab
    assert listed(client.get("/ui/jobs", params={"user": "alice"}).text) == ab
    assert listed(client.get("/ui/jobs", params={"user": "nobody"}).text) == []
    assert "<td>alice</td>" in client.get("/ui/jobs").text  # the owner column
    # bad input: 400 with the field named, never a 500
    bad = client.get("/ui/jobs", params={"status": "DONE"})
    assert bad.status_code == 400 and "status" in bad.text and "DONE" in bad.text
    both = client.get("/ui/jobs", params={"user": "x", "mine": "1"})
    assert both.status_code == 400 and "mine" in both.text
    assert client.get("/ui/jobs", params={"user": "bad name!"}).status_code == 400
    assert client.get("/ui/jobs", params={"cursor": "zzz"}).status_code == 400
    # the admin sees every team and may pick one
    login(client, tokens["admin"])
    every = listed(client.get("/ui/jobs").text)
    assert {a, b, c} <= set(every)
    assert listed(client.get("/ui/jobs", params={"team": "nlp", "q": "resnet"}).text) == [c]
    assert listed(client.get("/ui/jobs", params={"user": "bob"}).text) == [c]
    # the live region keeps the filters (htmx re-fetches the page's own url)
    page = client.get("/ui/jobs?q=resnet&team=nlp").text
    assert 'hx-get="/ui/jobs?q=resnet&amp;team=nlp"' in page


def test_job_list_pages_and_time_columns(ui: Ui, db: Database) -> None:
    from gpufleet.api import ui as ui_module

    client, tokens, _ = ui
    made = [named(db, "nlp", f"page-{i}") for i in range(ui_module.JOBS_PAGE + 5)]
    login(client, tokens["nlp"])
    first = client.get("/ui/jobs", params={"q": "page-"}).text
    rows = listed(first)
    newest_first = sorted(made, reverse=True)  # (ids sort by time, not within a millisecond)
    assert rows == newest_first[: ui_module.JOBS_PAGE]
    nxt = re.search(r'id="next-page" href="|href="(/ui/jobs\?[^"]+)" id="next-page"', first)
    assert nxt and nxt.group(1)
    second = client.get(html.unescape(nxt.group(1))).text
    assert listed(second) == newest_first[ui_module.JOBS_PAGE :]
    assert 'id="next-page"' not in second and 'id="first-page"' in second
    # TIME and LEFT as the CLI's list: a running attempt with a max runtime
    spec = JobSpec(command=("true",), resources=Resources(1), max_runtime_s=3600)
    job_id = submit_job(db, team_id="nlp", idempotency_key=str(uuid.uuid4()), spec=spec).job_id
    r = place(db, job_id, "n1", 1, become_leader(db))
    from gpufleet.services import runs

    db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token))
    db.run_write(lambda s: runs.confirm_start(s, r.run_id, r.token, 4242, node_id="n1"))
    api = client.get(
        f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {tokens['nlp']}"}
    ).json()
    assert api["status"] == "RUNNING"
    row = client.get("/ui/jobs").text.split(f'data-job="{job_id}"', 1)[1].split("</tr>", 1)[0]
    elapsed = re.search(r'class="elapsed">(\d+):(\d\d):(\d\d)<', row)
    left = re.search(r'class="left">(\d+):(\d\d):(\d\d)<', row)
    assert elapsed and left, row
    secs = [
        int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)) for m in (elapsed, left)
    ]
    assert 3590 <= secs[0] + secs[1] <= 3600


def test_user_text_is_escaped_in_the_list_job_and_cancel_pages(ui: Ui, db: Database) -> None:
    client, tokens, _ = ui
    job_id = named(db, "vision", XSS_NAME, command=("echo", "<img src=x onerror=alert(2)>"))
    login(client, tokens["vision"])
    for path in (
        "/ui/jobs",
        f"/ui/jobs?q={XSS_NAME}",
        f"/ui/jobs/{job_id}",
        f"/ui/jobs/{job_id}/cancel",
    ):
        page = client.get(path)
        assert page.status_code == 200, path
        assert XSS_NAME not in page.text and "<img src=x" not in page.text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text, path


def test_artifacts_download_through_the_artifact_routes(
    ui: Ui, db: Database, tmp_path: Path
) -> None:
    client, tokens, _ = ui
    store = ObjectStore(str(tmp_path / "o"))
    job_id = finish_backdated(db, store, "vision", "n1", __import__("datetime").timedelta(0), 0)
    login(client, tokens["vision"])
    page = client.get(f"/ui/jobs/{job_id}").text
    link = f'href="/ui/jobs/{job_id}/artifacts/model.bin"'
    assert link in page
    got = client.get(f"/ui/jobs/{job_id}/artifacts/model.bin")
    assert got.status_code == 200 and got.content == b"weights"
    assert got.headers["content-disposition"] == 'attachment; filename="model.bin"'
    # the same bytes and checksum as the REST route
    api = client.get(
        f"/v1/jobs/{job_id}/artifacts/model.bin",
        headers={"Authorization": f"Bearer {tokens['vision']}"},
    )
    assert api.content == got.content
    assert api.headers["x-gpufleet-sha256"] == got.headers["x-gpufleet-sha256"]
    assert client.get(f"/ui/jobs/{job_id}/artifacts/nope.bin").status_code == 404
    assert client.get(f"/ui/jobs/{job_id}/artifacts/../MANIFEST.json").status_code == 404
    # another team: not found; no session: the login page
    login(client, tokens["nlp"])
    assert client.get(f"/ui/jobs/{job_id}/artifacts/model.bin").status_code == 404
    client.cookies.clear()
    r = client.get(f"/ui/jobs/{job_id}/artifacts/model.bin", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"


@pytest.mark.parametrize(
    ("path", "fallback", "encoded"),
    [
        ("日本.txt", "__.txt", "%E6%97%A5%E6%9C%AC.txt"),
        ("sub/ü.txt", "_.txt", "%C3%BC.txt"),
        ('q"u%o.txt', "q_u_o.txt", "q%22u%25o.txt"),
    ],
)
def test_a_non_ascii_artifact_name_downloads_with_an_rfc_6266_header(
    ui: Ui, db: Database, tmp_path: Path, path: str, fallback: str, encoded: str
) -> None:
    """Both routes answer 200 with an ASCII Content-Disposition: an ASCII fallback name and
    the UTF-8 name percent-encoded (once a 500: the header could not be encoded)."""
    client, tokens, _ = ui
    store = ObjectStore(str(tmp_path / "o"))
    job_id = finish_backdated(db, store, "vision", "n1", timedelta(0), 0, more=(path,))
    login(client, tokens["vision"])
    want = f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{encoded}"
    url = f"/jobs/{job_id}/artifacts/{quote(path)}"
    for got in (
        client.get(f"/ui{url}"),
        client.get(f"/v1{url}", headers={"Authorization": f"Bearer {tokens['vision']}"}),
    ):
        assert got.status_code == 200, got.text
        assert got.content == path.encode()
        assert got.headers["content-disposition"] == want
        assert got.headers.get_list("content-disposition")[0].isascii()


def test_a_gangs_log_by_rank(ui: Ui, db: Database, tmp_path: Path) -> None:
    client, tokens, _ = ui
    store = ObjectStore(str(tmp_path / "o"))
    for n in ("g1", "g2"):
        create_node(db, n, gpus=2)
    spec = JobSpec(command=("true",), resources=Resources(2, nodes=2, gpus_per_node=1))
    job_id = submit_job(db, team_id="vision", idempotency_key=str(uuid.uuid4()), spec=spec).job_id
    epoch = become_leader(db)
    gang = db.run_write(
        lambda s: allocate.reserve_gang(
            s,
            job_id=job_id,
            members=[(0, "g1", 1), (1, "g2", 1)],
            seen_fencing_epoch=0,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
        )
    )
    for rank, m in enumerate(gang.members):
        store.put_bytes(
            f"{attempt_prefix(job_id, m.run_id)}/logs/output.log",
            f"hello from rank {rank}\n".encode(),
        )
    login(client, tokens["vision"])
    page = client.get(f"/ui/jobs/{job_id}").text
    assert 'id="ranks"' in page
    assert f'href="/ui/jobs/{job_id}?rank=1"' in page and 'data-rank="0" class="on"' in page
    assert "hello from rank 0" in page and "hello from rank 1" not in page
    one = client.get(f"/ui/jobs/{job_id}", params={"rank": "1"}).text
    assert "hello from rank 1" in one and f'hx-get="/ui/jobs/{job_id}/log?rank=1"' in one
    assert "hello from rank 1" in client.get(f"/ui/jobs/{job_id}/log", params={"rank": "1"}).text
    # a rank the attempt does not have: rank 0, with a note; garbage: a 400 naming rank
    seven = client.get(f"/ui/jobs/{job_id}?rank=7").text
    assert "hello from rank 0" in seven and "no rank 7 (ranks: 0, 1)" in seven
    bad = client.get(f"/ui/jobs/{job_id}?rank=x")
    assert bad.status_code == 400 and "rank" in bad.text
    # a single-node job has no selector
    with db.read() as s:
        single = s.scalar(
            __import__("sqlalchemy").select(JobRunRow.job_id).where(JobRunRow.gang_size == 1)
        )
    if single is not None:
        assert 'id="ranks"' not in client.get(f"/ui/jobs/{single}").text


def test_cancel_needs_the_confirmation_page(ui: Ui) -> None:
    client, tokens, ids = ui
    login(client, tokens["vision"])
    page = client.get(f"/ui/jobs/{ids['waiting']}").text
    assert f'id="cancel" href="/ui/jobs/{ids["waiting"]}/cancel"' in page
    # a post without the confirmation (an old one-click form) only leads to the question
    r = client.post(
        f"/ui/jobs/{ids['waiting']}/cancel", data={"csrf": form_csrf(page)}, follow_redirects=False
    )
    assert r.status_code == 303 and r.headers["location"] == f"/ui/jobs/{ids['waiting']}/cancel"
    assert 'id="job-status">PENDING' in client.get(f"/ui/jobs/{ids['waiting']}").text
    confirm = client.get(f"/ui/jobs/{ids['waiting']}/cancel").text
    assert 'name="confirm" value="yes"' in confirm and 'id="confirm-cancel"' in confirm
    r = client.post(
        f"/ui/jobs/{ids['waiting']}/cancel",
        data={"csrf": form_csrf(confirm), "confirm": "yes"},
        follow_redirects=False,
    )
    assert r.status_code == 303 and r.headers["location"] == f"/ui/jobs/{ids['waiting']}"
    assert 'id="job-status">CANCELLED<' in client.get(f"/ui/jobs/{ids['waiting']}").text
    assert 'id="cancel-finished"' in client.get(f"/ui/jobs/{ids['waiting']}/cancel").text
    # the confirmation without the session's form token is refused
    r = client.post(f"/ui/jobs/{ids['vision']}/cancel", data={"confirm": "yes", "csrf": "x"})
    assert r.status_code == 403
    # another team's job: not found, on both steps
    assert client.get(f"/ui/jobs/{ids['fenced']}/cancel").status_code == 404


def test_a_pending_job_shows_why_budget_warnings_and_what_would_start_it(
    ui: Ui, db: Database
) -> None:
    client, tokens, ids = ui
    warning = "vision has used 95% of its weekly GPU-hour budget (<b>soft</b>)"
    db.run_write(
        lambda s: s.execute(
            update(JobRow)
            .where(JobRow.id == ids["waiting"])
            .values(
                pending_reason={
                    "code": "insufficient_capacity",
                    "message": "no node has 4 free GPUs",
                    "details": {"budget_warnings": [warning]},
                }
            )
        )
    )
    login(client, tokens["vision"])
    page = client.get(f"/ui/jobs/{ids['waiting']}").text
    why = page.split('id="why"', 1)[1]
    assert "insufficient_capacity" in why and "no node has 4 free GPUs" in why
    warn = page.split('id="budget-warnings"', 1)[1].split("</ul>", 1)[0]
    assert html.escape(warning, quote=False) in warn and "<b>" not in warn
    api = client.get(
        f"/v1/jobs/{ids['waiting']}/suggestions",
        headers={"Authorization": f"Bearer {tokens['vision']}"},
    ).json()
    box = page.split('id="suggestions"', 1)[1].split("</div>", 1)[0]
    if api["suggestions"]:
        for sg in api["suggestions"]:
            assert html.escape(sg["message"]) in box
    else:
        assert html.escape(api["none_reason"] or "No single change") in box
    # only a full page load runs the what-if passes, not the 2 s live refresh
    live = client.get(f"/ui/jobs/{ids['waiting']}", headers={"HX-Request": "true"}).text
    assert 'id="suggestions"' not in live and 'id="budget-warnings"' in live
    # a job that is not waiting has neither
    other = client.get(f"/ui/jobs/{ids['vision']}").text
    assert 'id="suggestions"' not in other and 'id="why"' not in other


def test_step_series_sums_the_intervals_holding_at_each_instant() -> None:
    from gpufleet.api.ui import step_series

    spans = [(0.0, 10.0, 2.0), (5.0, 15.0, 1.0), (7.0, 7.0, 9.0)]  # the last one is empty
    assert step_series(spans, [-1, 0, 4.9, 5, 9.99, 10, 14, 15, 20]) == [0, 2, 2, 3, 3, 1, 1, 0, 0]
    assert step_series([], [0, 1]) == [0, 0]


def test_usage_page_charts_allocation_queue_and_wait_by_size(
    ui: Ui, db: Database, tmp_path: Path
) -> None:
    from datetime import timedelta

    from gpufleet.api import ui as ui_module

    client, tokens, _ = ui
    store = ObjectStore(str(tmp_path / "o"))
    # vision: a 1-GPU attempt reserved 3 h ago that ended just now, beside the fixture's
    # running 2-GPU attempt (reserved just now) and its waiting 4-GPU job
    finish_backdated(db, store, "vision", "n1", timedelta(hours=3), 0)
    login(client, tokens["vision"])
    page = client.get("/ui/usage").text
    alloc = re.search(r'id="chart-allocated" data-now="([0-9.]+)" data-peak="([0-9.]+)"', page)
    wait = re.search(r'id="chart-waiting" data-now="([0-9.]+)"', page)
    assert alloc and wait, page
    assert float(alloc[1]) == 2.0 and float(alloc[2]) == 2.0  # the running attempt now
    assert float(wait[1]) == 1.0  # the 4-GPU job
    assert re.search(r'<polyline points="[0-9., ]+" class="series allocated"/>', page)
    sizes = dict(re.findall(r'data-size="([^"]+)" data-count="(\d+)"', page))
    assert sizes == {"1": "1", "2-4": "1", "5-8": "0", "9+": "0"}
    with db.read() as s:
        p = auth.authenticate(s, tokens["vision"])
        charts = ui_module.charts_context(s, p)
    values = charts["series"][0]["values"]
    per_h = (ui_module.CHART_POINTS - 1) / ui_module.CHART_HOURS
    assert values[0] == 0.0 and values[-1] == 2.0
    assert values[-1 - round(per_h)] == 1.0  # an hour ago: the ended 1-GPU attempt
    assert values[-1 - round(4 * per_h)] == 0.0  # four hours ago: nothing yet
    # the 2 s live refresh does not redraw the charts (they are drawn at page load)
    live = client.get("/ui/usage", headers={"HX-Request": "true"}).text
    assert 'id="charts"' not in live


def test_a_team_token_is_not_shown_other_teams_job_ids(ui: Ui, db: Database) -> None:
    client, tokens, ids = ui
    theirs, mine = ids["fenced"], ids["waiting"]  # nlp's job; vision's waiting one

    def as_leader(s) -> None:
        s.get(JobRow, mine).pending_reason = {
            "code": "no_node_fits_now",
            "message": f"The free GPUs on n1 are held for job {theirs}.",
            "details": {"held_for_job": theirs},
        }

    db.run_write(as_leader)
    login(client, tokens["vision"])
    for path in (f"/ui/jobs/{mine}", "/ui/queue"):
        page = client.get(path)
        assert page.status_code == 200, page.text
        assert theirs not in page.text and "a job of another team" in page.text, path
    login(client, tokens["admin"])
    assert theirs in client.get(f"/ui/jobs/{mine}").text


def test_job_list_status_filters_and_echoed_values(ui: Ui, db: Database) -> None:
    client, tokens, ids = ui
    login(client, tokens["vision"])
    both = client.get("/ui/jobs?status=PENDING&status=RUNNING")
    assert both.status_code == 200, both.text
    assert {ids["waiting"], ids["vision"]} <= set(listed(both.text))  # any of them, not the last
    lower = listed(client.get("/ui/jobs", params={"status": "pending"}).text)
    assert ids["waiting"] in lower and ids["vision"] not in lower  # any case, as the CLI
    comma = listed(client.get("/ui/jobs", params={"status": "pending,running"}).text)
    assert set(comma) == set(listed(both.text))
    bad = client.get("/ui/jobs?status=PENDING&status=DONE")
    assert bad.status_code == 400 and "status" in bad.text and "DONE" in bad.text
    nul = client.get("/ui/jobs?user=%00")
    assert nul.status_code == 400 and "user" in nul.text
    assert "\x00" not in nul.text and "\\x00" in nul.text


def test_job_page_rank_is_checked(ui: Ui) -> None:
    client, tokens, ids = ui
    login(client, tokens["vision"])
    job = ids["vision"]  # single-node: rank 0 only
    for raw in ("abc", "-1", "1.5", "%00"):
        r = client.get(f"/ui/jobs/{job}?rank={raw}")
        assert r.status_code == 400 and "rank" in r.text, (raw, r.text)
        assert "\x00" not in r.text
        assert client.get(f"/ui/jobs/{job}/log?rank={raw}").status_code == 400
    far = client.get(f"/ui/jobs/{job}?rank=99")
    assert far.status_code == 200
    assert 'id="rank-note"' in far.text and "no rank 99" in far.text
    assert 'id="rank-note"' not in client.get(f"/ui/jobs/{job}?rank=0").text
