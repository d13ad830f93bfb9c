"""The web dashboard in a real browser: Playwright driving Debian's Chromium
(``apt-get install chromium``; never a downloaded browser) against a live platform
(controller + API in this process, a real agent, real jobs) with jobs of two teams.

Screenshots of every page go to ``$GPUFLEET_SCREENSHOT_DIR`` (default
``artifacts/screenshots`` under the repository root, ignored by git).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from gpufleet.services import auth
from tests.e2e.harness import Fleet

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("GPUFLEET_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(
    os.environ.get(
        "GPUFLEET_SCREENSHOT_DIR", Path(__file__).resolve().parents[2] / "artifacts/screenshots"
    )
)
XSS_NAME = "<script>alert(1)</script>"


def py(code: str, marker: str) -> list[str]:
    return [sys.executable, "-c", code, marker]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright import sync_api as playwright

    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/ensure-services.sh)"
        )
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    """One SQLite platform for the whole module: teams vision and nlp, an admin token, one
    4-GPU node."""
    fleet = Fleet(tmp_path_factory.mktemp("ui"), scheduler_tick_s=0.2).start()
    try:
        admin = fleet.db.run_write(
            partial(auth.create_token, team_id="ops", is_admin=True, create_team_if_missing=True)
        )
        fleet.start_agent("node-a", gpus="4xH100-80GB")
        yield fleet, admin
    finally:
        fleet.stop()


csp_violations: list[str] = []
"""Console messages of the pages about the Content-Security-Policy (none expected)."""


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


def login(browser: Any, fleet: Fleet, token: str) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(20_000)
    page.on(
        "console",
        lambda m: csp_violations.append(m.text) if "Content Security Policy" in m.text else None,
    )
    page.goto(f"{fleet.api.url}/ui/")
    assert page.url.endswith("/ui/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    return page


def shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_admin_sees_grid_change_log_grow_and_cancels_from_the_page(
    browser: Any, live: tuple[Fleet, str]
) -> None:
    fleet, admin = live
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    page = login(browser, fleet, admin)
    page.wait_for_url("**/ui/fleet")
    grid = page.locator("#node-node-a .gpu")
    assert grid.count() == 4
    assert page.locator('#node-node-a .gpu[data-state="free"]').count() == 4
    shot(page, "fleet-idle")

    code = (
        "import time\nfor i in range(3000):\n    print('step', i, flush=True)\n    time.sleep(0.1)"
    )
    job_id = fleet.submit({"command": py(code, marker), "gpu_count": 2, "name": "trainer"})
    # the page polls (htmx): two cells turn "running" without a reload
    page.locator('#node-node-a .gpu[data-state="running"]').nth(1).wait_for()
    assert page.locator('#node-node-a .gpu[data-state="running"]').count() == 2
    assert page.locator('#node-node-a .gpu[data-state="free"]').count() == 2
    assert "trainer" in page.locator('#node-node-a .gpu[data-state="running"]').first.inner_text()
    shot(page, "fleet-running")

    # a second team waits behind it: the queue page explains why
    waiting = fleet.submit({"command": py("print(1)", marker), "gpu_count": 4}, team="nlp")
    page.goto(f"{fleet.api.url}/ui/queue")
    page.locator(f'tr[data-job="{waiting}"]').first.wait_for()
    assert page.locator('table.queue[data-team="nlp"]').count() == 1
    assert page.locator('#shares tr[data-team="vision"]').count() >= 1
    shot(page, "queue")

    # open the job from the grid; its log tail grows while it runs
    page.goto(f"{fleet.api.url}/ui/fleet")
    page.click(f'#node-node-a a[href="/ui/jobs/{job_id}"] >> nth=0')
    page.wait_for_url(f"**/ui/jobs/{job_id}")
    # (locator waits, not wait_for_function: the page's CSP forbids the eval it needs)
    expect(page.locator("#log")).to_contain_text("step")
    first = len(page.locator("#log").inner_text())
    deadline = time.monotonic() + 15
    while len(page.locator("#log").inner_text()) <= first + 20:
        assert time.monotonic() < deadline, "the log tail did not grow"
        time.sleep(0.2)
    assert page.locator("#job-status").inner_text() == "RUNNING"
    shot(page, "job-running")

    page.click("#cancel")  # a link to the confirmation: nothing is cancelled yet
    page.wait_for_url(f"**/ui/jobs/{job_id}/cancel")
    assert fleet.job(job_id)["cancel_requested"] is False
    shot(page, "job-cancel-confirm")
    page.click("#confirm-cancel")
    page.wait_for_url(f"**/ui/jobs/{job_id}")
    expect(page.locator("#job-status")).to_have_text("CANCELLED", timeout=30_000)
    assert fleet.job(job_id)["status"] == "CANCELLED"
    assert page.locator("#cancel").count() == 0
    assert page.locator("#attempts .step.cancelled, #attempts .step.preempted").count() >= 1
    shot(page, "job-cancelled")
    # the freed GPUs go to the waiting nlp job
    fleet.wait_status(waiting, {"SUCCEEDED"}, 60, team="nlp")
    page.goto(f"{fleet.api.url}/ui/usage")
    page.locator('#usage tr[data-team="vision"]').wait_for()
    shot(page, "usage")
    assert csp_violations == []  # htmx and ui.js run under the policy, no inline script
    page.close()


def test_a_team_token_cannot_see_another_teams_job(browser: Any, live: tuple[Fleet, str]) -> None:
    fleet, _ = live
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    theirs = fleet.submit({"command": py("print('vision only')", marker), "gpu_count": 1})
    fleet.wait_status(theirs, {"SUCCEEDED"}, 60)
    page = login(browser, fleet, fleet.tokens["nlp"])
    page.wait_for_url("**/ui/queue")
    assert page.locator("#who").inner_text().startswith("team: nlp")
    shot(page, "team-view-queue")
    assert page.locator(f'tr[data-job="{theirs}"]').count() == 0
    resp = page.goto(f"{fleet.api.url}/ui/jobs/{theirs}")
    assert resp is not None and resp.status == 404
    assert page.locator("#notfound").count() == 1
    assert "vision only" not in page.content()
    log = page.request.get(f"{fleet.api.url}/ui/jobs/{theirs}/log")
    assert log.status == 404
    # the grid shows other teams' GPUs without their names
    page.goto(f"{fleet.api.url}/ui/fleet")
    assert "vision" not in page.locator("#live").inner_text()
    shot(page, "team-view-fleet")
    page.close()


def test_user_text_is_escaped(browser: Any, live: tuple[Fleet, str]) -> None:
    fleet, admin = live
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    job_id = fleet.submit(
        {"command": py("print('<b>bold</b>')", marker), "gpu_count": 1, "name": XSS_NAME}
    )
    fleet.wait_status(job_id, {"SUCCEEDED"}, 60)
    page = login(browser, fleet, admin)
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(f"{fleet.api.url}/ui/jobs/{job_id}")
    expect(page.locator("#log")).to_contain_text("bold")
    assert page.locator("#job-title").inner_text().startswith(XSS_NAME)
    html = page.content()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert XSS_NAME not in html
    assert page.locator("#log b").count() == 0  # the log's markup is text, too
    page.goto(f"{fleet.api.url}/ui/queue")
    assert page.locator(f'#recent tr[data-job="{job_id}"]').inner_text().startswith(XSS_NAME)
    time.sleep(0.5)
    assert dialogs == []
    page.close()


class AttackerSite:
    """A page served from another port of the same host (same site, another origin) whose
    script posts a form to the dashboard as soon as it loads."""

    def __init__(self, action: str, fields: dict[str, str]) -> None:
        import html
        import http.server
        import threading

        inputs = "".join(
            f'<input name="{html.escape(k)}" value="{html.escape(v)}">' for k, v in fields.items()
        )
        body = (
            f'<form id="f" method="post" action="{html.escape(action)}">{inputs}</form>'
            "<script>document.getElementById('f').submit()</script>"
        ).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_page_on_another_port_cannot_cancel_or_switch_the_session(
    browser: Any, live: tuple[Fleet, str]
) -> None:
    """Same host, another port: the same site, so the SameSite=Strict cookie goes along; the
    Sec-Fetch-Site/Origin check and the form token refuse the posts and nothing changes."""
    fleet, admin = live
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    victim = fleet.submit(
        {"command": py("import time; time.sleep(600)", marker), "gpu_count": 1}, team="nlp"
    )
    page = login(browser, fleet, admin)
    page.wait_for_url("**/ui/fleet")
    cancel = AttackerSite(f"{fleet.api.url}/ui/jobs/{victim}/cancel", {"csrf": "guess"})
    switch = AttackerSite(f"{fleet.api.url}/ui/login", {"token": fleet.tokens["vision"]})
    try:
        for site in (cancel, switch):
            page.goto(site.url)
            page.wait_for_load_state()
            page.wait_for_url(f"{fleet.api.url}/**")
            assert "Cross-site request refused" in page.content()
        assert fleet.job(victim, team="nlp")["cancel_requested"] is False
        page.goto(f"{fleet.api.url}/ui/fleet")  # still the admin's session
        assert page.locator("#who").inner_text().startswith("admin: ops")
        # the dashboard's own form still works
        page.goto(f"{fleet.api.url}/ui/jobs/{victim}")
        page.click("#cancel")
        page.click("#confirm-cancel")
        expect(page.locator("#job-status")).to_have_text("CANCELLED", timeout=30_000)
    finally:
        cancel.close()
        switch.close()
        page.close()


def test_pages_fit_a_phone(browser: Any, live: tuple[Fleet, str]) -> None:
    """At 375 px wide (a phone) no page scrolls sideways: wide tables scroll in their box."""
    fleet, admin = live
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    job_id = fleet.submit(
        {"command": py("print('x' * 300)", marker), "gpu_count": 1, "name": "phone-" + "w" * 60}
    )
    fleet.wait_status(job_id, {"SUCCEEDED"}, 60)
    page = login(browser, fleet, admin)
    page.wait_for_url("**/ui/fleet")
    page.set_viewport_size({"width": 375, "height": 740})
    for path in ("fleet", "queue", "jobs", f"jobs/{job_id}", "usage", f"jobs/{job_id}/cancel"):
        page.goto(f"{fleet.api.url}/ui/{path}")
        page.locator("main").wait_for()
        width = page.evaluate("document.documentElement.scrollWidth")
        wide = page.evaluate(  # what overflows, should one
            "Array.from(document.querySelectorAll('main *'))"
            ".filter(e => e.scrollWidth > 380 && getComputedStyle(e).overflowX === 'visible')"
            ".map(e => e.tagName + '#' + e.id + ' ' + e.scrollWidth)"
        )
        assert width <= 375, (path, width, wide)
        shot(page, "phone-" + path.replace("/", "-").replace(job_id, "job"))
    page.goto(f"{fleet.api.url}/ui/jobs?q=phone-")
    assert page.locator(f'#jobs tr[data-job="{job_id}"]').count() == 1
    page.close()
